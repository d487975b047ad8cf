"""Megatron's optimizer classes (megatron-core 0.16.1, real classes built on CPU the way
tests/scripts/megatron_cpu.py builds them) get their adapter from the class alone; msprobe's
opt_ty is checked against it; the Megatron instrumentor attaches to what its wrapped functions
return, with the model chunks as virtual-pipeline stages."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from conftest import MLP, ROOT
from msmon import TrainerMon
from msmon.config import ConfigError
from msmon.seams.adapter_choice import adapter_for

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
import megatron_cpu  # noqa: E402  (imports megatron.core)
from megatron.core.optimizer.optimizer import ChainedOptimizer  # noqa: E402


@pytest.fixture
def fp32_opt():
    return megatron_cpu.fp32_optimizer(MLP().parameters(), megatron_cpu.optimizer_config())


@pytest.fixture
def float16_opt():
    return megatron_cpu.float16_optimizer(list(MLP().to(torch.bfloat16).parameters()), megatron_cpu.optimizer_config())


def test_each_megatron_class_gets_its_adapter(fp32_opt, float16_opt):
    assert type(adapter_for(fp32_opt)).__name__ == "FP32Adapter"
    assert type(adapter_for(float16_opt)).__name__ == "Float16Adapter"
    chained = adapter_for(ChainedOptimizer([fp32_opt, float16_opt]))
    assert type(chained).__name__ == "ChainedAdapter"
    assert [type(p).__name__ for p in chained.parts] == ["FP32Adapter", "Float16Adapter"]


def test_float16_weights_are_the_fp32_main_copies_and_moments_are_keyed_by_model_parameter(float16_opt):
    adapter = adapter_for(float16_opt)
    model_params = [p for g in float16_opt.float16_groups for p in g]
    assert adapter.params() == model_params
    weights = adapter.weights(model_params)
    for p, main in zip(model_params, float16_opt.fp32_from_float16_groups[0]):
        assert weights[id(p)] is main and main.dtype == torch.float32
    for p in model_params:
        p.main_grad = torch.ones(p.shape)
    float16_opt.step()  # the real MixedPrecisionOptimizer.step, on CPU
    moments = adapter.moments(model_params)
    assert set(moments) == {id(p) for p in model_params}
    main = float16_opt.fp32_from_float16_groups[0][0]
    assert moments[id(model_params[0])].exp_avg is float16_opt.optimizer.state[main]["exp_avg"]


def test_an_opt_ty_msprobe_does_not_know_is_refused_before_training(write_config, output_dir, fp32_opt):
    monitor = TrainerMon(write_config({"wg_distribution": True}), opt_ty="Megatron_Distributed")
    with pytest.raises(ConfigError, match="opt_ty.*Megatron_DistributedOptimizer"):
        monitor.set_monitor(MLP(), fp32_opt)
    monitor.close()


def test_an_opt_ty_that_contradicts_the_class_is_reported_and_the_class_wins(fp32_opt, caplog):
    with caplog.at_level(logging.WARNING, logger="msmon"):
        adapter = adapter_for(fp32_opt, "Megatron_DistributedOptimizer")
    assert type(adapter).__name__ == "FP32Adapter"
    assert "does not match" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="msmon"):
        adapter_for(fp32_opt, "Megatron_FP32Optimizer")
    assert "does not match" not in caplog.text


def test_megatron_functions_are_wrapped_on_import_and_restored_after(write_config):
    import megatron.core.optimizer as core_optimizer

    from msmon.hooks import Session
    from msmon.hooks.megatron import instrumentor as meg_hook

    original = core_optimizer.get_megatron_optimizer
    meg_hook.instrument(Session.from_file(write_config({}), TrainerMon))
    try:
        assert core_optimizer.get_megatron_optimizer.__wrapped__ is original
    finally:
        meg_hook.uninstrument()
    assert core_optimizer.get_megatron_optimizer is original


def test_the_wrapped_builder_attaches_with_the_model_chunks_as_vpp_stages(write_config, output_dir):
    from msmon.hooks import Session
    from msmon.hooks.megatron import instrumentor as meg_hook

    session = Session.from_file(write_config({"param_distribution": True, "format": "csv"}), TrainerMon)
    chunks = [MLP(), MLP()]

    def build(config, model_chunks):  # get_megatron_optimizer's signature; Megatron's own needs CUDA
        params = [p for chunk in model_chunks for p in chunk.parameters()]
        return megatron_cpu.fp32_optimizer(params, megatron_cpu.optimizer_config())

    wrapped = meg_hook._wrap(session, build, "get_megatron_optimizer", "arguments")
    optimizer = wrapped(megatron_cpu.optimizer_config(), chunks)
    (monitor,) = session.monitors
    try:
        assert monitor.models == chunks
        assert {(mp.vpp_stage, mp.name) for mp in monitor.params} == {
            (c, n) for c in (0, 1) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        }
        for p in optimizer.get_parameters():
            p.main_grad = torch.zeros(p.shape)
        optimizer.step()
        assert monitor.steps_recorded == 1
    finally:
        monitor.close()


def test_an_inner_optimizer_step_outside_an_optimizer_step_records_no_reduced_gradient(write_config, output_dir):
    """Frameworks step their inner optimizer outside an optimizer step too (Megatron's
    distributed optimizer on loading a checkpoint, with zero gradients): msmon reads grad_reduced
    in that optimizer's step pre-hook only within a step of the optimizer it monitors."""
    model = MLP()
    opt = megatron_cpu.fp32_optimizer(model.parameters(), megatron_cpu.optimizer_config())
    monitor = TrainerMon(write_config({"wg_distribution": True, "format": "api", "ops": ["norm"]}))
    monitor.set_monitor(model, opt)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.optimizer.step()  # a checkpoint load's dummy step
    assert len(monitor.ctx.buffer) == 0
    for p in model.parameters():
        p.main_grad = torch.full(p.shape, 3.0)
    opt.step()  # Megatron's own step: main_grad becomes `.grad`, then the inner step reads it
    reduced, _ = monitor.generate_wgrad_metrics()
    assert {tag: row["norm"] for tag, row in reduced.items()} == pytest.approx(
        {f"0:{n}/rank0/grad_reduced": 3.0 * p.numel() ** 0.5 for n, p in model.named_parameters()}
    )
    monitor.close()
