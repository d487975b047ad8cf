"""msmon steps aside inside program transforms that run the model's forward: `torch.jit.trace`
(its hooks' ops would join the traced graph, and the trace check would fail), `torch.jit.script`
(which compiles every forward hook of a module, and cannot compile msmon's) and `torch.func`
transforms (vmap and grad for per-sample gradients, whose wrapped tensors have no storage).
Everything outside them keeps being recorded."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from conftest import rank_dir, read_csv_rows
from msmon import TrainerMon

CONFIG = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "param_distribution": True,
    "format": ["csv"],
    "ops": ["norm", "max"],
    "ndigits": 12,
}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


@pytest.fixture
def msmon_log(caplog):
    logging.getLogger("msmon").propagate = True
    caplog.set_level(logging.INFO, logger="msmon")
    return caplog


def nodes(traced: torch.jit.ScriptModule) -> list[str]:
    return [node.kind() for node in traced.inlined_graph.nodes()]


def test_torch_jit_trace_of_a_training_mode_model_with_activations_on_traces_the_model_alone(
    write_config, output_dir, msmon_log
):
    plain = torch.jit.trace(mlp(), torch.randn(3, 8))
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(CONFIG))
    mon.set_monitor(model, optimizer)
    inputs = []
    for step in range(3):
        x = torch.randn(3, 8)
        inputs.append(x)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            traced = torch.jit.trace(model, torch.randn(3, 8))  # checks the trace against a rerun
    mon.close()
    assert nodes(traced) == nodes(plain)
    x = torch.randn(3, 8)
    assert torch.equal(traced(x), model(x))
    rows = read_csv_rows(rank_dir(output_dir), "actv")
    assert {int(r["step"]) for r in rows} == {0, 1, 2}
    assert not [r for r in msmon_log.records if r.levelno >= logging.WARNING], msmon_log.text


def test_torch_jit_script_of_a_monitored_model_compiles_the_model_alone_and_the_eager_model_keeps_recording(
    write_config, output_dir, msmon_log
):
    plain = torch.jit.script(mlp())
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(CONFIG))
    mon.set_monitor(model, optimizer)

    def hooks() -> dict:
        return {name: list(m._forward_hooks.items()) for name, m in model.named_modules()}

    for step in range(3):
        if step == 1:
            before = hooks()
            scripted = torch.jit.script(model)
            assert hooks() == before  # msmon's hooks are back on the eager model, in their order
        model(torch.randn(3, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    assert nodes(scripted) == nodes(plain)
    x = torch.randn(3, 8)
    assert torch.equal(scripted(x), model(x))
    rows = read_csv_rows(rank_dir(output_dir), "actv")
    assert {int(r["step"]) for r in rows} == {0, 1, 2}
    assert not [r for r in msmon_log.records if r.levelno >= logging.WARNING], msmon_log.text


def per_sample_training(config_path: str | None, only_inside_transform: bool = False):
    """SGD on per-sample gradients (torch.func's vmap over grad), with one eager forward per
    step (the logged loss) unless `only_inside_transform`; the per-sample gradients of every
    step and the eager outputs."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = None
    if config_path:
        mon = TrainerMon(config_path)
        mon.set_monitor(model, optimizer)

    def loss_of(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    gen = torch.Generator().manual_seed(1)
    per_sample, outputs = [], []
    for _ in range(3):
        x, y = torch.randn(5, 8, generator=gen), torch.randint(0, 4, (5,), generator=gen)
        if not only_inside_transform:
            with torch.no_grad():  # the first layer's output, computed without calling the module
                outputs.append(F.linear(x, model[0].weight, model[0].bias))
            model(x)
        params = {k: v.detach() for k, v in model.named_parameters()}
        grads = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
        per_sample.append(grads)
        for name, p in model.named_parameters():
            p.grad = grads[name].mean(0)
        optimizer.step()
        optimizer.zero_grad()
    if mon is not None:
        mon.close()
    return per_sample, outputs


def test_per_sample_gradients_by_torch_func_with_activations_on_leave_every_collector_recording(
    write_config, output_dir, msmon_log
):
    plain, _ = per_sample_training(None)
    monitored, outputs = per_sample_training(write_config(CONFIG))
    for step_plain, step_monitored in zip(plain, monitored):
        assert all(torch.equal(step_plain[k], step_monitored[k]) for k in step_plain)
    assert not [r for r in msmon_log.records if r.levelno >= logging.WARNING], msmon_log.text
    out = rank_dir(output_dir)
    for category in ("actv", "grad_reduced", "param_origin", "param_updated"):
        assert {int(r["step"]) for r in read_csv_rows(out, category)} == {0, 1, 2}, category
    first_layer = [r for r in read_csv_rows(out, "actv") if r["name"].endswith("0.output")]
    assert [int(r["step"]) for r in first_layer] == [0, 1, 2]  # the eager forward's, once per step
    for row in first_layer:
        expected = outputs[int(row["step"])].double()
        assert float(row["norm"]) == pytest.approx(float(expected.norm()), rel=1e-6)
        assert float(row["max"]) == pytest.approx(float(expected.max()), rel=1e-6)


def test_a_step_whose_forward_ran_only_inside_torch_func_is_said_so_not_blamed_on_torch_compile(
    write_config, output_dir, msmon_log
):
    per_sample_training(write_config(CONFIG), only_inside_transform=True)
    warnings = [r.getMessage() for r in msmon_log.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "only inside torch.func" in warnings[0] and "torch.compile" not in warnings[0]
    out = rank_dir(output_dir)
    assert {int(r["step"]) for r in read_csv_rows(out, "grad_reduced")} == {0, 1, 2}
    assert read_csv_rows(out, "actv") == []
