"""Is the bundled example's output byte-identical between two revisions of msmon?

A refactor must not change what msmon writes. This runs `make demo`'s job (examples/train_tiny_gpt.py
under `msmon run` with examples/monitor.json, 2 ranks on gloo) once with the working tree's msmon and
once with msmon at REV (checked out into a temporary git worktree), then compares every CSV file,
byte for byte, and the anomaly dumps' records. Exit status 0 when identical, 1 otherwise.

    python benchmarks/output_identity.py --rev main~3          # compare with an earlier commit
    python benchmarks/output_identity.py --rev HEAD --steps 6  # a quicker run

TensorBoard event files are compared by their scalars (tag, step, value; their records carry wall
times). summary.json (the monitor's cost) and config.json are listed, not compared.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_job import ROOT, demo_command, demo_env  # noqa: E402

COMPARED_SUFFIXES = (".csv",)  # what msmon computes: statistic rows, alerts, anomaly records as CSV
DUMP_DIR = "anomaly_detected"
RANK_DIR = re.compile(r"^.*-rank(\d+)-[0-9a-f]+$")
EVENTS = re.compile(r"^events\.out\.tfevents\..*$")  # the name carries the time, host and pid


def run_example(src: Path, out: Path, steps: int) -> None:
    """The example job with msmon imported from `src` (a checkout's src/ folder)."""
    env = demo_env(src, out)
    cmd = demo_command(ROOT / "examples" / "train_tiny_gpt.py", "--steps", str(steps))
    done = subprocess.run(cmd, env=env, cwd=str(out.parent), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the example failed with msmon from {src}:\n{done.stdout}\n{done.stderr}")


def files_under(base: Path) -> dict[str, Path]:
    """Files by their path under `base`, rank directories named by rank alone (their names
    carry the start time: `Dec04_00-48-54-rank1-619b575d`)."""
    out = {}
    for path in sorted(base.rglob("*")):
        if path.is_file():
            parts = [RANK_DIR.sub(r"rank\1", part) for part in path.relative_to(base).parts]
            parts[-1] = EVENTS.sub("events.out.tfevents", parts[-1])
            out["/".join(parts)] = path
    return out


def scalars(path: Path) -> list[tuple[str, int, float]]:
    """A TensorBoard event file's scalars (tag, step, value), read with tensorboard's own loader."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out = []
    for event in EventFileLoader(str(path)).Load():
        for value in event.summary.value:
            number = (
                float(tensor_util.make_ndarray(value.tensor)) if value.HasField("tensor") else float(value.simple_value)
            )
            out.append((value.tag, event.step, number))
    return out


def dump_records(path: Path) -> list[str]:
    """An anomaly dump's lines without the wall-clock fields (they differ between any two runs)."""
    import json

    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            lines.append(line)
            continue
        if isinstance(record, dict):
            for key in ("time", "wall_time", "timestamp", "created"):
                record.pop(key, None)
        lines.append(json.dumps(record, sort_keys=True))
    return lines


def compare(before: Path, after: Path, rev: str) -> list[str]:
    """The differences, one line each; empty when the outputs are the same."""
    old, new = files_under(before), files_under(after)
    problems = [f"only in {rev}: {name}" for name in sorted(set(old) - set(new))]
    problems += [f"only in the working tree: {name}" for name in sorted(set(new) - set(old))]
    compared = 0
    for name in sorted(set(old) & set(new)):
        if name.endswith(COMPARED_SUFFIXES):
            compared += 1
            if not filecmp.cmp(old[name], new[name], shallow=False):
                problems.append(f"differs: {name}")
        elif name.endswith("events.out.tfevents"):
            compared += 1
            if scalars(old[name]) != scalars(new[name]):
                problems.append(f"differs (scalars): {name}")
        elif DUMP_DIR in Path(name).parts and name.endswith((".json", ".jsonl")):
            compared += 1
            if dump_records(old[name]) != dump_records(new[name]):
                problems.append(f"differs: {name}")
    if compared == 0:
        problems.append("no CSV file was written: nothing was compared")
    print(
        f"compared {compared} files; not compared (clock- or process-dependent): "
        f"{sorted(n for n in set(old) & set(new) if not n.endswith((*COMPARED_SUFFIXES, 'tfevents')) and DUMP_DIR not in n)}"  # noqa: E501
    )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the git revision to compare the working tree with")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of the example (make demo: 20)")
    parser.add_argument("--keep", type=Path, help="keep both outputs in this folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="msmon-identity-"))
    tree = work / "rev"
    try:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.rev],
            check=True,
            capture_output=True,
        )
        (work / "before").mkdir()
        (work / "after").mkdir()
        run_example(tree / "src", work / "before" / "monitor_output", args.steps)
        run_example(ROOT / "src", work / "after" / "monitor_output", args.steps)
        problems = compare(work / "before" / "monitor_output", work / "after" / "monitor_output", args.rev)
        if args.keep:
            shutil.copytree(work / "before", args.keep / "before", dirs_exist_ok=True)
            shutil.copytree(work / "after", args.keep / "after", dirs_exist_ok=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    for line in problems:
        print(line)
    print("identical" if not problems else f"{len(problems)} differences against {args.rev}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
