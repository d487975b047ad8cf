"""Adam's update and ratio computed for all parameters at once with `_foreach_*` ops equal the
per-parameter formula, whether the steps are numbers (a framework's group step) or 0-d tensors
(torch.optim's), with the ratio 0 where v_hat is 0."""

from __future__ import annotations

import torch

from msmon.collectors.adam_update import updates_and_ratios
from msmon.seams.adapters import Moments


def per_parameter(m: torch.Tensor, v: torch.Tensor, beta1: float, beta2: float, eps: float, step: float):
    m_hat = m / (1 - beta1**step)
    root_v = (v / (1 - beta2**step)).sqrt()
    return m_hat / (root_v + eps), torch.where(root_v > 0, m_hat / root_v, torch.zeros_like(m_hat))


def moments_batch(step_of):
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 5), (7,), (3, 2, 2)]
    ms = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    vs = [torch.rand(s, generator=gen) * 1e-6 for s in shapes]
    vs[1][2] = 0.0  # a row the optimizer never touched: ratio 0, not NaN
    ms[1][2] = 0.0
    settings = [(0.9, 0.999, 1e-8, 3), (0.8, 0.99, 1e-6, 10), (0.9, 0.95, 1e-8, 1)]
    moments = [Moments(m, v, step_of(t), b1, b2, eps) for m, v, (b1, b2, eps, t) in zip(ms, vs, settings)]
    return ms, vs, settings, moments


def check(step_of) -> None:
    ms, vs, settings, moments = moments_batch(step_of)
    updates, ratios = updates_and_ratios(ms, vs, moments)
    for m, v, (b1, b2, eps, t), update, ratio in zip(ms, vs, settings, updates, ratios):
        want_update, want_ratio = per_parameter(m, v, b1, b2, eps, float(t))
        torch.testing.assert_close(update, want_update, rtol=1e-6, atol=0)
        torch.testing.assert_close(ratio, want_ratio, rtol=1e-6, atol=0)
        assert not torch.isnan(ratio).any()


def test_number_steps_give_the_per_parameter_update_and_ratio():
    check(lambda t: t)


def test_tensor_steps_give_the_per_parameter_update_and_ratio():
    check(lambda t: torch.tensor(float(t)))
