"""A copy of a monitored optimizer (`copy.deepcopy`, pickling, `torch.save`) is a snapshot, not
the optimizer training runs: it gets no monitor of its own, not even at its first step, and it
is exactly what the same copy is without msmon."""

from __future__ import annotations

import copy
import glob
import io
import pickle
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from conftest import MLP, read_csv_rows
from msmon import TrainerMon
from msmon.hooks import Session, torch_optim

TORCHS_SETSTATE = torch.optim.Optimizer.__dict__["__setstate__"]  # read before any test instruments
CONFIG = {"wg_distribution": True, "format": ["csv"], "ops": ["norm", "max"]}
HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


@pytest.fixture
def session(write_config, output_dir):
    session = Session.from_file(write_config(CONFIG), TrainerMon)
    torch_optim.instrument(session)
    yield session
    torch_optim.uninstrument()
    for monitor in list(session.monitors):
        monitor.close()


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def rank_dirs(output_dir: Path) -> list[str]:
    return sorted(glob.glob(str(output_dir / "*-rank0-*")))


def copies(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple]:
    """(model, optimizer) copied in each way a script copies them."""
    shared = {id(p): p for p in model.parameters()}
    saved = io.BytesIO()
    torch.save((model, optimizer), saved)
    saved.seek(0)
    return {
        "deepcopy of both": copy.deepcopy((model, optimizer)),
        "deepcopy sharing the parameters": (model, copy.deepcopy(optimizer, shared)),
        "pickle": pickle.loads(pickle.dumps((model, optimizer))),
        "torch.save": torch.load(saved, weights_only=False),
    }


def test_a_copied_optimizer_gets_no_monitor_and_the_original_keeps_its_own(session, output_dir):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    step(model, optimizer)
    (monitor,) = session.monitors
    for how, (model_copy, optimizer_copy) in copies(model, optimizer).items():
        step(model_copy, optimizer_copy)
        assert session.monitors == [monitor], how
        assert optimizer_copy.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"], how
    step(model, optimizer)
    monitor.close()
    (out,) = rank_dirs(output_dir)
    assert {r["step"] for r in read_csv_rows(Path(out), "grad_reduced")} == {"0", "1"}


def test_a_copy_of_a_monitored_optimizer_holds_exactly_what_a_copy_made_without_msmon_holds(session):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    step(model, optimizer)
    assert optimizer._optimizer_step_pre_hooks  # msmon's own hooks are on the original
    for how, (_, optimizer_copy) in copies(model, optimizer).items():
        for name in HOOK_DICTS:
            assert getattr(optimizer_copy, name) == OrderedDict(), (how, name)


def test_an_optimizer_built_before_msmon_that_loads_a_state_dict_is_still_attached_at_its_first_step(
    write_config, output_dir
):
    """load_state_dict goes through Optimizer.__setstate__ too, on an optimizer already built."""
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # before instrumentation: unseen
    step(model, optimizer)
    session = Session.from_file(write_config(CONFIG), TrainerMon)
    torch_optim.instrument(session)
    try:
        optimizer.load_state_dict(optimizer.state_dict())
        step(model, optimizer)
    finally:
        torch_optim.uninstrument()
    (monitor,) = session.monitors
    monitor.close()
    assert len(rank_dirs(output_dir)) == 1


def test_uninstrument_gives_optimizer_its_own_setstate_back(session):
    assert torch.optim.Optimizer.__dict__["__setstate__"] is not TORCHS_SETSTATE
    torch_optim.uninstrument()
    assert torch.optim.Optimizer.__dict__["__setstate__"] is TORCHS_SETSTATE


def test_an_optimizer_monitored_through_the_api_pickles_and_copies_without_msmons_hooks(write_config, output_dir):
    from msmon import TrainerMon

    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = TrainerMon(write_config(CONFIG), params_have_main_grad=False)
    mon.set_monitor(model, optimizer)
    step(model, optimizer)
    try:
        for how, (model_copy, optimizer_copy) in copies(model, optimizer).items():
            for name in HOOK_DICTS:
                assert getattr(optimizer_copy, name) == OrderedDict(), (how, name)
            step(model_copy, optimizer_copy)
    finally:
        mon.close()
    (out,) = rank_dirs(output_dir)
    assert {r["step"] for r in read_csv_rows(Path(out), "grad_reduced")} == {"0"}
