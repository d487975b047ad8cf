"""How far a reader walks from the optimizer's step hook to a gradient's CSV row: the msmon files
and the file-to-file hops on the way, traced (sys.setprofile, on the training and the writer
thread) in one SGD step of nn.Linear(4, 4) with `wg_distribution` and CSV output.

The path is the union of the msmon call stacks, each from its thread's outermost msmon frame, on
the training thread from the step hook up to the hand-over to the writer thread (`submit`), on
the writer thread up to the CSV sink's `write` (or `write_step`), at
- every msmon call ("calls": what a reader follows from the hook to the row; issue 41 measured
  13 files and 19 hops at 27a2ae3 in a like way, this script 14 and 20), or
- the calls handed the gradient or its row ("row": the tensor, the row's key `grad_reduced`, or
  a list, a host batch or a step record holding one: where its statistics are read, recorded,
  taken, copied and handed over).
Files: the distinct msmon source files on those stacks. Hops: the distinct caller -> callee
edges on them whose two frames are in different files (and how many distinct file pairs they
join). Deterministic: a measure of the code's shape, not of time; it runs on a loaded machine.

    python benchmarks/gradient_path.py                    # this checkout
    python benchmarks/gradient_path.py --rev 27a2ae3      # a revision, from a temporary git worktree
    python benchmarks/gradient_path.py --src ../other/src # another checkout's src/ folder
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRACE = r"""
import json, os, sys, tempfile, threading
import torch
import msmon

PACKAGE = os.path.dirname(msmon.__file__) + os.sep
GRADS = []
stacks = []  # lists of (file, function) from the thread's outermost msmon frame inward


def msmon_stack(frame):
    out = []
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE):
            out.append((frame.f_code.co_filename[len(PACKAGE):], frame.f_code.co_name))
        frame = frame.f_back
    return out[::-1]


def is_row_key(value):
    return getattr(value, "category", None) == "grad_reduced" and isinstance(getattr(value, "name", None), str)


def carries(value):
    # the gradient, its row's key, or a list, a batch or a record holding one
    if any(value is g for g in GRADS) or is_row_key(value):
        return True
    if isinstance(value, (list, tuple)):
        return any(any(v is g for g in GRADS) or is_row_key(v) for v in value[:256])
    keys = getattr(value, "keys", None)
    return isinstance(keys, list) and any(is_row_key(k) for k in keys[:256])


arrived = set()  # the threads that reached their end of the path: the hand-over, the CSV row
ALL = sys.argv[1] == "calls"


def trace(frame, event, arg):
    thread = threading.get_ident()
    if event != "call" or thread in arrived or not frame.f_code.co_filename.startswith(PACKAGE):
        return
    code = frame.f_code
    end = (code.co_name in ("write", "write_step") and code.co_filename.endswith("csv_sink.py")) or (
        code.co_name == "submit" and code.co_filename.endswith("writer.py")
    )
    if end or ALL or any(carries(value) for value in list(frame.f_locals.values())):
        stacks.append(msmon_stack(frame))
    if end:
        arrived.add(thread)


out = tempfile.mkdtemp()
os.environ["MONITOR_OUTPUT_DIR"] = out
config = os.path.join(out, "monitor.json")
with open(config, "w") as f:
    json.dump({"wg_distribution": True, "format": ["csv"]}, f)
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
threading.setprofile(trace)  # the writer thread, whenever the monitor starts it
monitor = msmon.TrainerMon(config)
monitor.set_monitor(model, optimizer)
model(torch.randn(2, 4)).sum().backward()
GRADS[:] = [p.grad for p in model.parameters()]
sys.setprofile(trace)
optimizer.step()
sys.setprofile(None)
monitor.close()
threading.setprofile(None)
print(json.dumps(stacks))
"""


def measure(src: Path, mode: str) -> dict:
    """Files and hops of the gradient path with msmon imported from `src` (a checkout's src/)."""
    env = dict(os.environ, PYTHONPATH=str(src), MSMON_NATIVE_STATS="0", OMP_NUM_THREADS="1")
    args = [sys.executable, "-c", TRACE, mode]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the traced step failed with msmon from {src}:\n{done.stderr[-3000:]}")
    stacks = [[tuple(frame) for frame in stack] for stack in json.loads(done.stdout.strip().splitlines()[-1])]
    if not any(stack and stack[-1][1] in ("write", "write_step") for stack in stacks):
        raise SystemExit("the CSV sink's write was not traced")
    edges = {(a, b) for stack in stacks for a, b in zip(stack, stack[1:])}
    files = sorted({file for stack in stacks for file, _ in stack})
    hops = sorted({(a[0], b[0], f"{a[1]} -> {b[1]}") for a, b in edges if a[0] != b[0]})
    return {"files": files, "hops": hops, "file_pairs": sorted({(a, b) for a, b, _ in hops})}


MODES = {
    "calls": "every msmon call from the step hook to the CSV row",
    "row": "the calls handed the gradient or its row",
}


def source_of(rev: str, scratch: Path) -> Path:
    """`src/` of `rev`, checked out into a temporary git worktree."""
    work = scratch / "rev"
    add = ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(work), rev]
    subprocess.run(add, check=True, capture_output=True)
    return work / "src"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--rev", help="a git revision to measure (a temporary worktree)")
    where.add_argument("--src", type=Path, help="a checkout's src/ folder to measure")
    parser.add_argument("--verbose", "-v", action="store_true", help="list the files and the hops")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        src = args.src or (source_of(args.rev, Path(scratch)) if args.rev else ROOT / "src")
        try:
            found = {mode: measure(src.resolve(), mode) for mode in MODES}
        finally:
            if args.rev:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(scratch) / "rev")])
    label = args.rev or str(args.src or "this checkout")
    for mode, what in MODES.items():
        got = found[mode]
        print(
            f"{label}, {what}: {len(got['files'])} files, {len(got['hops'])} hops ({len(got['file_pairs'])} file pairs)"
        )
        if args.verbose:
            for file in got["files"]:
                print(f"  {file}")
            for caller, callee, calls in got["hops"]:
                print(f"  {caller} -> {callee}  ({calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
