"""The torch.distributed instrumentor and the collective collector, in one process.

A real gloo process group of one rank is enough for wrapping, call sites, async completion,
P2POp identity, failure containment and torch.compile; values across ranks are checked with
torchrun in test_comm_e2e.py.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.distributed as dist

from conftest import MLP, rank_dir, read_csv_rows
from msmon import TrainerMon
from msmon.collectors.comm import CodelineFilter
from msmon.hooks import torch_distributed
from msmon.seams import collective_listeners as cc
from msmon.seams.collective_calls import COLLECTIVES, CallSite, CollectiveCall

c10d = dist.distributed_c10d


class Recorder:
    """A listener that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, list[float]]] = []
        self.sites: list[CallSite] = []

    def wants(self) -> bool:
        return True

    def on_launch(self, call: CollectiveCall) -> bool:
        self.sites.append(call.site)
        self.events.append(("launch", call.op, [t.sum().item() for t in call.inputs]))
        return True

    def on_complete(self, call: CollectiveCall) -> None:
        self.events.append(("complete", call.op, [t.sum().item() for t in call.outputs]))


class Broken(Recorder):
    def on_launch(self, call: CollectiveCall) -> bool:
        raise RuntimeError("listener bug")


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def msmon_log():
    handler = LogLines()
    logger = logging.getLogger("msmon")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def test_instrument_wraps_every_collective_and_uninstrument_restores_the_originals(world_of_one):
    originals = {name: getattr(c10d, name) for name in COLLECTIVES}
    original_wait = dist.Work.wait
    assert torch_distributed.instrument()
    for name, original in originals.items():
        wrapper = getattr(dist, name)
        assert wrapper is not original and wrapper.__wrapped__ is original, name
        assert getattr(c10d, name) is wrapper, name
    assert dist.Work.wait is not original_wait
    torch_distributed.uninstrument()
    for name, original in originals.items():
        assert getattr(dist, name) is original and getattr(c10d, name) is original, name
    assert dist.Work.wait is original_wait


def test_wrapping_is_counted_so_a_monitor_detach_keeps_the_launchers_wrapping(world_of_one):
    original = dist.all_reduce
    assert torch_distributed.instrument()  # the launcher, when torch is imported
    assert torch_distributed.instrument()  # idempotent: the registry may switch it on again
    assert cc.acquire()  # a monitor's attach
    cc.release()  # that monitor's detach
    assert dist.all_reduce is not original
    torch_distributed.uninstrument()
    assert dist.all_reduce is original


def test_launcher_leaves_torch_untouched_when_the_config_has_cc_off(world_of_one, write_config):
    from msmon.hooks import Session

    original = dist.all_reduce
    off = Session.from_file(write_config({"cc_distribution": {"enable": False}}, "off.json"), TrainerMon)
    assert not torch_distributed.instrument(off)
    assert dist.all_reduce is original and not cc.is_instrumented()
    on = Session.from_file(write_config({"cc_distribution": {"enable": True}}, "on.json"), TrainerMon)
    assert torch_distributed.instrument(on) and dist.all_reduce is not original
    torch_distributed.uninstrument()
    assert dist.all_reduce is original


def test_sync_collective_is_seen_before_and_after_with_its_result_unchanged(world_of_one):
    recorder = Recorder()
    torch_distributed.instrument()
    cc.add_listener(recorder)
    t = torch.arange(4.0)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    cc.remove_listener(recorder)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert recorder.events == [
        ("launch", "all_reduce", [6.0]),
        ("complete", "all_reduce", [6.0]),
        ("launch", "broadcast", [6.0]),
        ("complete", "broadcast", [6.0]),
    ]


def test_async_collective_is_measured_when_its_work_is_waited_not_at_launch(world_of_one):
    recorder = Recorder()
    torch_distributed.instrument()
    cc.add_listener(recorder)
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    assert recorder.events == [("launch", "all_reduce", [3.0])]
    work.wait()
    assert recorder.events[-1] == ("complete", "all_reduce", [3.0])
    work.wait()  # a second wait reports nothing more
    assert len(recorder.events) == 2
    cc.remove_listener(recorder)


def test_async_work_nobody_waits_on_is_reported_at_step_end_once_completed(world_of_one):
    recorder = Recorder()
    torch_distributed.instrument()
    cc.add_listener(recorder)
    work = dist.all_reduce(torch.ones(2), async_op=True)
    deadline = time.monotonic() + 30
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    cc.deliver_completed()  # what the collector does at the step's end
    assert recorder.events == [("launch", "all_reduce", [2.0]), ("complete", "all_reduce", [2.0])]
    work.wait()  # already reported: nothing more
    cc.deliver_completed()
    assert len(recorder.events) == 2
    cc.remove_listener(recorder)


def test_call_site_is_the_calling_line_outside_torch_and_msmon(world_of_one):
    recorder = Recorder()
    torch_distributed.instrument()
    cc.add_listener(recorder)
    line = _line() + 1  # the next line's number: the call's
    dist.all_reduce(torch.ones(1))
    cc.remove_listener(recorder)
    site = recorder.sites[0]
    assert site.short == f"test_comm.py[{line}]"
    assert site.full == f"{__file__}[{line}]"
    assert site.function == "test_call_site_is_the_calling_line_outside_torch_and_msmon"


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_failing_listener_never_stops_the_collective(world_of_one, msmon_log):
    broken, recorder = Broken(), Recorder()
    torch_distributed.instrument()
    cc.add_listener(broken)
    cc.add_listener(recorder)
    t = torch.full((2,), 5.0)
    for _ in range(2):
        dist.all_reduce(t)
    cc.remove_listener(broken)
    cc.remove_listener(recorder)
    assert t.tolist() == [5.0, 5.0]
    assert [kind for kind, _, _ in recorder.events] == ["launch", "complete"] * 2  # the others still hear
    assert sum("collective monitoring" in line and "listener bug" in line for line in msmon_log) == 1


def test_p2pop_accepts_both_versions_of_isend_and_keeps_torchs_identity_check(world_of_one):
    original_isend, original_irecv = dist.isend, dist.irecv
    torch_distributed.instrument()
    t = torch.ones(2)
    for op, current in [(original_isend, dist.isend), (dist.isend, dist.isend), (original_irecv, dist.irecv)]:
        p2p = dist.P2POp(op, t, 0)
        assert p2p.op is current and p2p.op is getattr(c10d, current.__name__)
    wrapped_isend = dist.isend  # a library that copied the wrapper
    torch_distributed.uninstrument()
    p2p = dist.P2POp(wrapped_isend, t, 0)
    assert p2p.op is original_isend is c10d.isend


def test_codeline_entries_name_a_line_or_are_regular_expressions():
    def site(path: str, line: int) -> CallSite:
        return CallSite(path, line, "f")

    everything = CodelineFilter([])
    assert everything(site("/x/train.py", 1))
    exact = CodelineFilter(["train.py[23]"])
    assert exact(site("/job/train.py", 23))
    assert not exact(site("/job/train.py", 2))
    assert not exact(site("/job/pretrain.py", 23))
    assert not exact(site("/job/train.py", 230))
    nested = CodelineFilter(["models/block.py[7]"])
    assert nested(site("/job/models/block.py", 7)) and not nested(site("/job/block.py", 7))
    pattern = CodelineFilter([r"layers/.*\.py\[4\d\]"])
    assert pattern(site("/job/layers/attn.py", 42)) and not pattern(site("/job/layers/attn.py", 52))


def test_monitor_with_cc_on_and_distributed_not_initialised_warns_and_trains(write_config, output_dir, msmon_log):
    assert not dist.is_initialized()
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"cc_distribution": {"enable": True}, "wg_distribution": True, "format": "csv"}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    assert any("cc_distribution is on but torch.distributed is not initialised" in line for line in msmon_log)
    assert len(read_csv_rows(rank_dir(output_dir), "grad_reduced")) == 2 * 4
    assert not read_csv_rows(rank_dir(output_dir), "other")
    assert not cc.is_instrumented()  # the monitor's close unwrapped what its attach wrapped


def test_compiled_collective_is_traced_by_dynamo_without_a_graph_break(world_of_one):
    import torch._dynamo

    recorder = Recorder()
    torch_distributed.instrument()
    cc.add_listener(recorder)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    explained = torch._dynamo.explain(step)(torch.ones(3))
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    result = compiled(torch.ones(3))
    cc.remove_listener(recorder)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0
    assert result.tolist() == [3.0, 3.0, 3.0]


class AllReduceBothWays(torch.autograd.Function):
    """Tensor-parallel style: a collective in forward and one in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(_with_nan(x))  # line: forward
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(_with_nan(grad))  # line: backward
        return grad


class SyncingSGD(torch.optim.SGD):
    """An optimizer that communicates inside its step (as ZeRO does)."""

    def step(self, closure=None):
        dist.all_reduce(torch.tensor([float("nan")]))  # line: optimizer
        return super().step(closure)


def _with_nan(t: torch.Tensor) -> torch.Tensor:
    copy = t.detach().clone()
    copy.view(-1)[0] = float("nan")
    return copy


def test_each_row_carries_the_pass_its_collective_ran_in(world_of_one, write_config, output_dir):
    import json

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    optimizer = SyncingSGD(model.parameters(), lr=0.1)
    mon = TrainerMon(
        write_config(
            {
                "cc_distribution": {"enable": True},
                "format": "csv",
                "ops": ["norm", "nans"],
                "alert": {"rules": [{"rule_name": "AnomalyNan"}], "dump": True},
            }
        )
    )
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    AllReduceBothWays.apply(model(torch.randn(2, 3))).sum().backward()
    dist.all_reduce(_with_nan(model.weight.grad))  # line: after backward
    optimizer.step()
    mon.close()
    source = open(__file__).read().splitlines()
    line = {
        tag: n
        for n, text in enumerate(source, 1)
        for tag in ("forward", "backward", "optimizer", "after backward")
        if text.endswith(f"# line: {tag}")
    }
    dumped = [
        json.loads(text)
        for text in (output_dir / "anomaly_detected" / "rank0" / "anomaly.jsonl").read_text().splitlines()
    ]
    stages = {record["name"]: record["stage"] for record in dumped}
    assert stages == {
        f"all_reduce@test_comm.py[{line['forward']}]/post": "forward",
        f"all_reduce@test_comm.py[{line['backward']}]/post": "backward",
        f"all_reduce@test_comm.py[{line['after backward']}]/post": "backward",
        f"all_reduce@test_comm.py[{line['optimizer']}]/post": "optimizer",
    }
    assert all(record["category"] == "other" for record in dumped)
    assert {record["tag"] for record in dumped} == {name.replace("/post", "/rank0/post") for name in stages}
