"""The torch.optim instrumentor, in-process: it finds the model and attaches on its own, and
what it records is what the TrainerMon API records for the same training."""

from __future__ import annotations

import filecmp
import gc
import glob
import json
import logging
import sys
import weakref
from pathlib import Path

import pytest
import torch

from conftest import MLP, ROOT, read_csv_rows
from msmon import TrainerMon
from msmon.hooks import Session, torch_optim
from msmon.hooks import handover as framework_attach
from msmon.seams.adapters import OptimizerGone

CONFIG = {
    "wg_distribution": True,
    "param_distribution": True,
    "mv_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "format": ["csv"],
    "ops": ["norm", "min", "max", "mean"],
}


@pytest.fixture
def session(write_config, output_dir):
    """The instrumentor switched on for this test, and everything it did undone after."""
    session = Session.from_file(write_config(CONFIG), TrainerMon)
    torch_optim.instrument(session)
    yield session
    torch_optim.uninstrument()
    for monitor in list(session.monitors):
        monitor.close()


def rank_dirs(output_dir: Path) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(output_dir / "*-rank0-*")))


def train(model, optimizer, steps=2, grad_acc=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        for _ in range(grad_acc):
            loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def test_attaches_when_the_optimizer_is_built_so_step_zero_is_complete(session, output_dir):
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert len(session.monitors) == 1 and session.monitors[0].models == [model]
    train(model, optimizer)
    session.monitors[0].close()
    (out,) = rank_dirs(output_dir)
    unreduced = read_csv_rows(out, "grad_unreduced")
    assert {(r["name"], r["step"]) for r in unreduced} >= {("fc1.weight", "0"), ("fc2.bias", "1")}
    actv_steps = {r["step"] for r in read_csv_rows(out, "actv")}
    assert actv_steps == {"0", "1"}
    assert {r["micro_step"] for r in read_csv_rows(out, "actv")} == {"0", "1"}  # grad_acc inferred: 2
    assert {r["step"] for r in read_csv_rows(out, "exp_avg")} == {"0", "1"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps_recorded"] == 2


def test_records_exactly_what_the_trainermon_api_records(write_config, tmp_path, monkeypatch):
    config = write_config(CONFIG)
    losses = {}
    for mode in ("api", "auto"):
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / mode))
        torch.manual_seed(0)
        session = Session.from_file(config, TrainerMon)
        if mode == "auto":
            torch_optim.instrument(session)
        try:
            model = MLP()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            if mode == "api":
                monitor = TrainerMon(config)
                monitor.set_monitor(model, optimizer)
            else:
                (monitor,) = session.monitors
            losses[mode] = train(model, optimizer, steps=3)
        finally:
            torch_optim.uninstrument()
        monitor.close()
    assert losses["api"] == losses["auto"]  # training itself is untouched
    (api_dir,), (auto_dir,) = rank_dirs(tmp_path / "api"), rank_dirs(tmp_path / "auto")
    csvs = sorted(p.name for p in api_dir.glob("*.csv"))
    assert csvs and csvs == sorted(p.name for p in auto_dir.glob("*.csv"))
    match, mismatch, errors = filecmp.cmpfiles(api_dir, auto_dir, csvs, shallow=False)
    assert mismatch == [] and errors == [] and len(match) == len(csvs)


def test_optimizer_classes_defined_later_by_the_user_are_attached_too(session):
    class MySGD(torch.optim.SGD):  # defined after instrumentation: seen through __init_subclass__
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)
            self.extra = True

    class Plain(torch.optim.Optimizer):  # a from-scratch optimizer
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    kept = []
    for cls, kwargs in ((MySGD, {"lr": 0.1}), (Plain, {})):
        model = MLP()
        kept.append((model, cls(model.parameters(), **kwargs)))
        train(*kept[-1], steps=1, grad_acc=1)
    assert [m.models for m in session.monitors] == [[model] for model, _ in kept]
    assert [m.steps_recorded for m in session.monitors] == [1, 1]


class AcceleratedLike(torch.optim.Optimizer):
    """accelerate's shape: an Optimizer subclass that never calls Optimizer.__init__ and
    forwards to the real optimizer in `.optimizer`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


class Wrapper(torch.nn.Module):
    """A DDP-like module wrapper: the model sits under `module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def test_wrappers_resolve_to_the_real_optimizer_and_the_users_names(session, output_dir):
    model = Wrapper(MLP())
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = AcceleratedLike(inner)
    train(model, wrapped, steps=1, grad_acc=1)
    (monitor,) = session.monitors
    assert monitor.models == [model]  # the root: the wrapper, not the inner MLP
    monitor.close()
    (out,) = rank_dirs(output_dir)
    names = {r["name"] for r in read_csv_rows(out, "grad_reduced")}
    assert names == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}  # no `module.` prefix
    actv = {r["name"] for r in read_csv_rows(out, "actv")}
    assert "fc1.input" in actv and not any(name.startswith("module") for name in actv)


def test_an_optimizer_built_inside_another_is_not_monitored_twice(session):
    class Sharded(torch.optim.Optimizer):
        """Builds its own inner optimizer, as ZeroRedundancyOptimizer does."""

        def __init__(self, params):
            params = list(params)
            super().__init__(params, {})
            self.local = torch.optim.SGD(params, lr=0.1)

        def step(self, closure=None):
            return self.local.step(closure)

    model = MLP()
    optimizer = Sharded(model.parameters())
    train(model, optimizer, steps=2, grad_acc=1)
    (monitor,) = session.monitors
    assert type(monitor.adapter.optimizer) is Sharded  # the outer one, whose step the script calls
    assert monitor.steps_recorded == 2


def test_each_optimizer_gets_its_own_monitor_and_output(session, output_dir):
    generator, discriminator = MLP(), torch.nn.Sequential(torch.nn.Linear(4, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=1e-3)
    for _ in range(2):
        discriminator(generator(torch.randn(4, 8)).detach()).mean().backward()
        opt_d.step()
        opt_d.zero_grad()
        discriminator(generator(torch.randn(4, 8))).mean().backward()
        opt_g.step()
        opt_g.zero_grad()
    monitors = list(session.monitors)
    assert [m.models for m in monitors] == [[generator], [discriminator]]
    for monitor in monitors:
        monitor.close()
    dirs = {Path(m.log_dir) for m in monitors}
    assert len(dirs) == 2 and set(rank_dirs(output_dir)) == dirs
    by_dir = {Path(m.log_dir): {r["name"] for r in read_csv_rows(Path(m.log_dir), "grad_reduced")} for m in monitors}
    assert by_dir[Path(monitors[0].log_dir)] == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert by_dir[Path(monitors[1].log_dir)] == {"0.weight", "0.bias"}


def test_two_optimizers_over_one_model_record_its_activations_once(session, output_dir):
    """Separate optimizers for parts of one model (GAN-style): one monitor each, but the model's
    module hooks are installed once, by the first; the other records its own parameters only."""
    model = MLP()
    opt_body = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    opt_head = torch.optim.Adam(model.fc2.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for _ in range(2):
            model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt_body.step()
        opt_head.step()
        opt_body.zero_grad()
        opt_head.zero_grad()
    first, second = session.monitors
    assert first.models == second.models == [model]
    for monitor in (first, second):
        monitor.close()
    actv = {m: read_csv_rows(Path(m.log_dir), "actv") for m in (first, second)}
    assert actv[second] == []
    keys = [(r["step"], r["micro_step"], r["name"]) for r in actv[first]]
    assert len(keys) == len(set(keys)) and {k[:2] for k in keys} == {(s, m) for s in "01" for m in "01"}
    assert {r["name"] for r in read_csv_rows(Path(first.log_dir), "grad_reduced")} == {"fc1.weight", "fc1.bias"}
    assert {r["name"] for r in read_csv_rows(Path(second.log_dir), "grad_reduced")} == {"fc2.weight", "fc2.bias"}


def test_when_the_monitor_recording_a_shared_model_goes_the_other_takes_its_activations_over(session, output_dir):
    model = MLP()
    opt_body = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    opt_head = torch.optim.SGD(model.fc2.parameters(), lr=0.1)
    first, second = session.monitors
    del opt_body
    gc.collect()
    assert session.monitors == [second]
    train(model, opt_head, steps=1, grad_acc=1)
    second.close()
    assert {r["name"] for r in read_csv_rows(Path(second.log_dir), "actv")} >= {"fc1.input", "fc2.output"}
    assert read_csv_rows(Path(first.log_dir), "actv") == []


def test_a_dropped_optimizer_is_collected_and_its_monitor_closed(session, caplog):
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, optimizer, steps=2, grad_acc=1)
    (monitor,) = session.monitors
    # held through weak references, never proxies: the script's own object, its own class
    assert monitor.optimizer is optimizer and type(monitor.adapter.optimizer) is torch.optim.Adam
    alive = weakref.ref(optimizer)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="msmon"):
        del optimizer
        gc.collect()
    assert alive() is None  # nothing of msmon kept it alive
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # closed cleanly
    assert session.monitors == []  # released, and with it the Adam state
    assert monitor.optimizer is None
    with pytest.raises(OptimizerGone, match="the Adam this monitor was attached to has been garbage-collected"):
        monitor.adapter.optimizer  # noqa: B018
    assert not model.fc1._forward_pre_hooks and not model._forward_hooks  # detached from the model
    summary = json.loads((Path(monitor.log_dir) / "summary.json").read_text())
    assert summary["steps_recorded"] == 2
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # the next one gets a fresh monitor
    train(model, optimizer, steps=1, grad_acc=1)
    assert len(session.monitors) == 1 and session.monitors[0] is not monitor


def test_a_monitor_attached_through_the_api_does_not_keep_its_optimizer_alive(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(CONFIG))
    monitor.set_monitor(model, optimizer)
    train(model, optimizer, steps=1, grad_acc=1)
    alive = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert alive() is None and monitor.optimizer is None
    monitor.close()
    assert json.loads((Path(monitor.log_dir) / "summary.json").read_text())["steps_recorded"] == 1


def test_a_framework_optimizer_dropped_by_the_script_is_collected_and_its_monitor_closed(session, output_dir):
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import megatron_cpu  # a real Megatron FP32Optimizer, built on CPU

    model = MLP()
    with framework_attach.suppressed():  # as the Megatron instrumentor builds it: its inner Adam is not ours
        optimizer = megatron_cpu.fp32_optimizer(model.parameters(), megatron_cpu.optimizer_config())
    monitor = framework_attach.attach(session, model, optimizer, "test")
    assert session.monitors == [monitor] and monitor.optimizer is optimizer
    alive = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert alive() is None and session.monitors == []
    assert json.loads((Path(monitor.log_dir) / "summary.json").read_text())["steps_recorded"] == 0


def test_the_undo_of_a_wrapped_framework_method_does_not_keep_its_object_alive():
    from msmon.seams.patching import wrap_method

    class Engine:  # stands for a DeepSpeed optimizer, whose reduce_ipg_grads the adapter wraps
        def reduce_ipg_grads(self):
            return "reduced"

    engine, seen = Engine(), []
    undo = wrap_method(engine, "reduce_ipg_grads", before=lambda: seen.append(1))
    assert engine.reduce_ipg_grads() == "reduced" and seen == [1]
    undo()
    assert "reduce_ipg_grads" not in engine.__dict__
    undo = wrap_method(engine, "reduce_ipg_grads", before=lambda: None)
    alive = weakref.ref(engine)
    del engine
    gc.collect()
    assert alive() is None
    undo()  # harmless once it is gone


def test_lbfgs_gradients_are_read_after_its_closure_ran(session, output_dir):
    model = MLP()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    x = torch.randn(4, 8)
    seen = []

    def closure():
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        if not seen:
            seen.append(model.fc2.weight.grad.norm().item())
        return loss

    optimizer.step(closure)
    session.monitors[0].close()
    (out,) = rank_dirs(output_dir)
    rows = {r["name"]: r for r in read_csv_rows(out, "grad_reduced")}
    assert float(rows["fc2.weight"]["norm"]) == pytest.approx(seen[0], rel=1e-5)


def test_manual_sgd_without_an_optimizer_runs_unharmed_and_attaches_nothing(session, output_dir):
    model = MLP()
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    assert session.monitors == []
    assert rank_dirs(output_dir) == []


@pytest.mark.parametrize(
    "attach, steps, start_step, note",
    [
        (False, 0, 0, "set_monitor was never called: no optimizer was monitored"),
        (True, 0, 0, "no optimizer step ran"),
        (
            True,
            3,
            5,
            "3 optimizer steps ran, none of them in the steps the config records (start_step, step_interval, "
            "collect_times, dynamic_on)",
        ),
        (True, 1, 0, None),
    ],
)
def test_a_monitor_that_recorded_no_step_says_why_in_its_summary(
    write_config, output_dir, attach, steps, start_step, note
):
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters())
    monitor = TrainerMon(write_config({**CONFIG, "start_step": start_step}))
    if attach:
        monitor.set_monitor(model, optimizer)
    train(model, optimizer, steps=steps, grad_acc=1)
    monitor.close()
    summary = json.loads((Path(monitor.log_dir) / "summary.json").read_text())
    assert summary["steps_recorded"] == (1 if note is None else 0)
    assert summary.get("note") == note


def test_an_optimizer_built_before_msmon_attaches_at_its_first_step(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # before instrumentation: unseen
    session = Session.from_file(write_config(CONFIG), TrainerMon)
    torch_optim.instrument(session)
    try:
        train(model, optimizer, steps=2, grad_acc=1)
    finally:
        torch_optim.uninstrument()
    (monitor,) = session.monitors
    monitor.close()
    (out,) = rank_dirs(output_dir)
    assert {r["step"] for r in read_csv_rows(out, "grad_reduced")} == {"0", "1"}  # step 0: gradients were final
    assert {r["step"] for r in read_csv_rows(out, "actv")} == {"1"}  # step 0's forward ran before the hooks


def test_an_optimizer_whose_model_lacks_the_targets_is_left_alone(write_config, output_dir, caplog):
    session = Session.from_file(write_config({**CONFIG, "targets": {"fc1": {}}}), TrainerMon)
    torch_optim.instrument(session)
    try:
        with caplog.at_level(logging.INFO, logger="msmon"):
            mlp, other = MLP(), torch.nn.Sequential(torch.nn.Linear(4, 1))
            optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mlp, other)]
    finally:
        torch_optim.uninstrument()
    assert [m.models for m in session.monitors] == [[mlp]]
    assert "SGD is not monitored: the config's targets are not in its model" in caplog.text
    assert len(optimizers) == 2
    for monitor in session.monitors:
        monitor.close()


def test_uninstrument_restores_every_optimizer_class(write_config, output_dir):
    before = {cls: cls.__dict__.get("__init__") for cls in (torch.optim.Optimizer, torch.optim.Adam, torch.optim.SGD)}
    session = Session.from_file(write_config(CONFIG), TrainerMon)
    torch_optim.instrument(session)
    assert torch.optim.Adam.__dict__["__init__"] is not before[torch.optim.Adam]
    torch_optim.uninstrument()
    assert {cls: cls.__dict__.get("__init__") for cls in before} == before
    assert "__init_subclass__" not in torch.optim.Optimizer.__dict__
    model = MLP()
    torch.optim.Adam(model.parameters())
    assert session.monitors == []


def test_a_framework_instrumentor_can_take_an_optimizer_over(session):
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    (monitor,) = session.monitors
    assert framework_attach.release(optimizer) and not framework_attach.release(optimizer)
    assert session.monitors == [] and not model._forward_hooks and not model.fc1._forward_pre_hooks
    train(model, optimizer, steps=1, grad_acc=1)  # decided: the first step does not attach again
    assert session.monitors == []
    with framework_attach.suppressed():
        other = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, other, steps=1, grad_acc=1)
    assert session.monitors == []
