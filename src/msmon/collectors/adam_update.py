"""Adam's update and ratio for every parameter at once, with multi-tensor (`_foreach_*`) ops.

update = m_hat / (sqrt(v_hat) + eps), ratio = m_hat / sqrt(v_hat) (0 where v_hat is 0), with
m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t). Computed parameter by parameter these are
about eight elementwise kernels each; here the bias corrections of all parameters come from one
vector computation and the elementwise steps are one `_foreach_*` call each for all parameters.
What stays per tensor: the ratio's mask (`where`, two kernels) and the histograms (a clamp and
`histc` each), which no foreach op computes. Where the steps are tensors (torch.optim's Adam
keeps one 0-d tensor per parameter) the bias corrections are 0-d tensors and the divisions take
torch's per-tensor fallback inside one `_foreach_div` call: one dispatch, but on CUDA one kernel
per tensor, as before; numbers (a framework's group-level step) take the fused multi-tensor path.
No host read either way: a step tensor is never read on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _corrections(moments: Sequence[Any], beta: str) -> list[Any]:
    """1 - beta^step per parameter: floats where every step is a number, else 0-d float64
    tensors (one vector computation when the steps are tensors on one device)."""
    steps = [m.step for m in moments]
    if not any(isinstance(s, torch.Tensor) for s in steps):
        return [1 - getattr(m, beta) ** float(s) for m, s in zip(moments, steps)]
    devices = {s.device for s in steps if isinstance(s, torch.Tensor)}
    if len(devices) == 1 and all(isinstance(s, torch.Tensor) and s.numel() == 1 for s in steps):
        device = devices.pop()
        stacked = torch.stack([s.reshape(()) for s in steps]).to(torch.float64)
        betas = torch.tensor([getattr(m, beta) for m in moments], dtype=torch.float64)
        if device.type != "cpu":
            betas = betas.to(device, non_blocking=True)
        return list((1 - torch.pow(betas, stacked)).unbind())
    return [  # mixed numbers and tensors: one by one
        1 - torch.pow(getattr(m, beta), s.to(torch.float64))
        if isinstance(s, torch.Tensor)
        else 1 - getattr(m, beta) ** float(s)
        for m, s in zip(moments, steps)
    ]


@torch.no_grad()
def updates_and_ratios(
    exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], moments: Sequence[Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The update and ratio tensors (float32 or wider) of every parameter, in order."""
    if not exp_avgs:
        return [], []
    m_hats = torch._foreach_div(exp_avgs, _corrections(moments, "beta1"))
    root_vs = torch._foreach_div(exp_avg_sqs, _corrections(moments, "beta2"))
    torch._foreach_sqrt_(root_vs)
    updates = torch._foreach_div(m_hats, torch._foreach_add(root_vs, [float(m.eps) for m in moments]))
    ratios = list(torch._foreach_div(m_hats, root_vs))
    zero = {}
    for i, (ratio, root_v) in enumerate(zip(ratios, root_vs)):
        key = (ratio.device, ratio.dtype)
        if key not in zero:
            zero[key] = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        ratios[i] = torch.where(root_v > 0, ratio, zero[key])  # 0/0: rows the optimizer never touched
    return list(updates), ratios
