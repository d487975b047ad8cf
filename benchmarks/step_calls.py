"""What one steady-state monitored step costs, counted rather than timed: on the training thread
the Python calls made inside msmon (cProfile: calls per function, and every call msmon code
makes, torch's Python functions and builtins included), the aten ops msmon dispatches
(TorchDispatchMode), and in the next step the bytecodes run (sys.settrace's opcode events: a
call count misses a function that got longer) and the exceptions raised and caught (one per
getattr(module, name, default) on a torch Module that lacks `name`); on the writer thread (which
shares the cores) the calls of that step's write; for revisions side by side. Deterministic, so
it runs on a loaded machine and finds where time went between two revisions before anyone times
them on a quiet one.

    python benchmarks/step_calls.py --rev 27a2ae3 --rev HEAD                # gpt-3.7M, all_xy and wg+mv+param
    python benchmarks/step_calls.py --rev 27a2ae3 --src src --configs all_xy --top 30

Each revision runs in its own process with msmon imported from it (a temporary git worktree;
`--src` names a checkout's src/ folder, the working tree's own included); the model, data and
config come from this checkout's benchmarks/workloads.py (msprobe's six ops). The kernel path of
the default install: each revision builds its native kernel at attach, as a first run does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GC_STEPS = 10  # steady-state steps over which the garbage collector's runs are counted

COUNT = r"""
import cProfile, json, os, pstats, sys, tempfile
import torch
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, sys.argv[1])
from bench_worker import attach
from step_calls import calls_by_function
from workloads import MODELS, monitor_config, train_step
import msmon

PACKAGE = os.path.dirname(msmon.__file__) + os.sep
model_name, config_name, warmup = sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
spec = MODELS[model_name]
model = spec.build()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(0)
monitor = attach("msmon", monitor_config(config_name, model), model, optimizer, tempfile.mkdtemp())
batches = [spec.batch_of(gen, torch.device("cpu")) for _ in range(max(warmup + 1, int(sys.argv[5])))]
for batch in batches[:warmup]:
    train_step(model, optimizer, batch)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE):
            frame = frame.f_back
        self.count += frame is not None
        return func(*args, **(kwargs or {}))


writer_profiler = cProfile.Profile()
write = monitor.writer._write


def profiled_write(step, *args):  # on the writer thread: the measured step's write only
    if step != measured:
        return write(step, *args)
    writer_profiler.enable()
    try:
        return write(step, *args)
    finally:
        writer_profiler.disable()


import gc

collections = [0, 0, 0]  # the garbage collector's runs by generation over `gc_steps` steps (each
gc_steps = int(sys.argv[5])  # stops every thread: the training's too)
gc.callbacks.append(lambda phase, info: phase == "start" and collections.__setitem__(
    info["generation"], collections[info["generation"]] + 1))
for batch in batches[:gc_steps]:
    train_step(model, optimizer, batch)
gc.callbacks.clear()
measured = monitor.step
monitor.writer._write = profiled_write
profiler = cProfile.Profile()
with Ops() as ops:
    profiler.enable()
    train_step(model, optimizer, batches[warmup])
    profiler.disable()
bytecodes = [0, 0, 0]  # the next step, on the training thread: every bytecode, msmon's, exceptions raised


def traced(frame, event, arg):
    frame.f_trace_opcodes = True
    ours = frame.f_code.co_filename.startswith(PACKAGE)

    def local(frame, event, arg):
        if event == "opcode":
            bytecodes[0] += 1
            bytecodes[1] += ours
        elif event == "exception" and arg[2].tb_next is None:  # where it was raised
            bytecodes[2] += 1
        return local

    return local


sys.settrace(traced)
train_step(model, optimizer, batches[warmup + 1])
sys.settrace(None)
monitor.close()


inside, made = calls_by_function(pstats.Stats(profiler).stats, PACKAGE)
writer_inside, writer_made = calls_by_function(pstats.Stats(writer_profiler).stats, PACKAGE)
print(json.dumps({"msmon_calls": inside, "calls_from_msmon": made, "aten_ops_from_msmon": ops.count,
                  "writer_calls": writer_inside, "writer_calls_from_msmon": writer_made,
                  "gc_collections": collections, "bytecodes": bytecodes[0], "msmon_bytecodes": bytecodes[1],
                  "exceptions_raised": bytecodes[2]}))
"""


def calls_by_function(stats: dict, package: str) -> tuple[dict[str, int], int]:
    """From pstats' table: the calls of each function of `package` ("path/file.py:name", the
    functions of one name in one file summed: closures made by several factories share theirs),
    and the number of calls that its code made to any function."""
    inside: dict[str, int] = {}
    made = 0
    for (file, _, name), (_, calls, _, _, callers) in stats.items():
        if file.startswith(package):
            key = f"{file[len(package) :]}:{name}"
            inside[key] = inside.get(key, 0) + calls
        made += sum(c[1] for caller, c in callers.items() if caller[0].startswith(package))
    return inside, made


def count(src: Path, model: str, config: str, warmup: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    env.pop("MSMON_NATIVE_STATS", None)
    args = [sys.executable, "-c", COUNT, str(HERE), model, config, str(warmup), str(GC_STEPS)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the counted step failed with msmon from {src}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def by_file_name(calls: dict[str, int]) -> dict[str, int]:
    """Calls keyed by file name and function, not path: a module moved to another folder
    between the revisions is the same code."""
    out: dict[str, int] = {}
    for name, n in calls.items():
        key = name.rsplit("/", 1)[-1]
        out[key] = out.get(key, 0) + n
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", default=[], help="a git revision (repeat to compare)")
    parser.add_argument("--src", action="append", default=[], type=Path, help="a checkout's src/ folder")
    parser.add_argument("--model", default="gpt-3.7M")
    parser.add_argument("--configs", nargs="+", default=["all_xy", "wg+mv+param"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="functions whose call counts changed most")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        sources: list[tuple[str, Path]] = [(str(s), s.resolve()) for s in args.src]
        for i, rev in enumerate(args.rev):
            work = Path(scratch) / f"rev{i}"
            add = ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(work), rev]
            subprocess.run(add, check=True, capture_output=True)
            sources.insert(i, (rev, work / "src"))
        try:
            for config in args.configs:
                found = {label: count(src, args.model, config, args.warmup) for label, src in sources}
                print(f"\n{args.model}, {config}: per steady-state step, on the training thread")
                for label, got in found.items():
                    calls = sum(got["msmon_calls"].values())
                    print(
                        f"  {label:>12}: {calls:6d} msmon function calls, {got['calls_from_msmon']:6d} calls made by "
                        f"msmon code, {got['aten_ops_from_msmon']:5d} aten ops dispatched from msmon; writer thread: "
                        f"{sum(got['writer_calls'].values()):6d} msmon calls, {got['writer_calls_from_msmon']:6d} "
                        f"made by it; garbage collections in {GC_STEPS} steps by generation: {got['gc_collections']}"
                    )
                    print(
                        f"  {'':>12}  {got['bytecodes']:6d} bytecodes run in the next step "
                        f"({got['msmon_bytecodes']} in msmon's functions), {got['exceptions_raised']} exceptions "
                        "raised (and caught)"
                    )
                if len(found) > 1:
                    (first, a), (last, b) = list(found.items())[0], list(found.items())[-1]
                    before, after = by_file_name(a["msmon_calls"]), by_file_name(b["msmon_calls"])
                    delta = {n: after.get(n, 0) - before.get(n, 0) for n in set(before) | set(after)}
                    print(f"  calls per function, {last} minus {first} (largest changes):")
                    for name, change in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
                        if change:
                            print(f"    {change:+6d}  {name}")
                    before, after = by_file_name(a["writer_calls"]), by_file_name(b["writer_calls"])
                    delta = {n: after.get(n, 0) - before.get(n, 0) for n in set(before) | set(after)}
                    print(f"  writer thread, calls per function, {last} minus {first}:")
                    for name, change in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
                        if change:
                            print(f"    {change:+6d}  {name}")
        finally:
            for i in range(len(args.rev)):
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(scratch) / f"rev{i}")]
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
