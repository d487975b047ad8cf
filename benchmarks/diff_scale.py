"""`msmon diff` at scale: two synthetic outputs that differ in one value, found with its step,
tensor and rank (issue 42: 512 ranks x 200 steps x 200 tensors, under 2 minutes on a 2-core
machine, peak memory stated).

    PYTHONPATH=src python benchmarks/diff_scale.py --work /tmp/diff_scale              # 512 x 200 x 200
    PYTHONPATH=src python benchmarks/diff_scale.py --work /tmp/small --ranks 16 --steps 20
    PYTHONPATH=src python benchmarks/diff_scale.py --work /tmp/small --ranks 16 --steps 20 --format parquet

A is written by benchmarks/synthetic_output.py (one CSV file per category and step, as msmon's
default step_count_per_record: 1 writes them: 512,000 files, 2 GiB). B is A again, every file
hard-linked (`--copy link`, the default: seconds instead of the half hour a second write of half
a million files takes) or copied (`--copy copy`: separate files, so that B's reads are reads of
their own), except one file: the reduced gradient of one tensor at one step on one rank, written
anew with that tensor's norm times 1 + 1e-3. Existing outputs under --work are reused.

With `--format parquet`, A and B are then exported (`msmon export --to parquet -o`, the Parquet
files alone, A's reused) and the Parquet files compared: a rank's files on both sides are joined
in DuckDB, and only the rows that differ are read.

Then `msmon diff A B --json` runs in a child process, timed: its wall time, the CPU seconds of it
and of its reading processes (which the load of a shared machine changes less than the wall),
and the peak resident memory of each (getrusage, read in that process as it ends). The answer's
first_divergence must name the step, tensor and rank changed; the script fails otherwise.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CATEGORY = "grad_reduced"
# `msmon ...` in this process, then what it and its children cost, written to argv[1]
MEASURED = """
import json, resource, sys
from msmon.launcher.cli import main
out, sys.argv, code = sys.argv[1], ["msmon", *sys.argv[2:]], 0
try:
    main()
except SystemExit as exc:
    code = exc.code
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
json.dump({"diff_cpu_s": round(me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, 1),
           "peak_rss_mib_main": round(me.ru_maxrss / 1024, 1),
           "peak_rss_mib_reading_process": round(kids.ru_maxrss / 1024, 1)}, open(out, "w"))
sys.exit(code)
"""


def write_a(path: str, args: argparse.Namespace) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, os.path.join(HERE, "synthetic_output.py"), "-o", path, "--ranks", str(args.ranks),
         "--steps", str(args.steps), "--tensors", str(args.tensors)],
        check=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},
    )  # fmt: skip
    return time.perf_counter() - started


def write_b(a: str, b: str, how: str) -> float:
    started = time.perf_counter()
    if how == "copy":
        shutil.copytree(a, b)
    else:
        shutil.copytree(a, b, copy_function=os.link)
    return time.perf_counter() - started


def change_one_value(b: str, rank: int, step: int, row: int) -> tuple[str, str]:
    """The norm of the `row`-th tensor in B's reduced-gradient file of `rank` at `step`, times
    1 + 1e-3, written as a new file (never through a link into A); returns (tensor, file)."""
    (rank_dir,) = glob.glob(os.path.join(b, f"*-rank{rank}-*"))
    path = os.path.join(rank_dir, f"{CATEGORY}_{step}-{step}.csv")
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    cells = lines[1 + row].split(",")
    cells[3] = repr(round(float(cells[3]) * 1.001, 6))
    lines[1 + row] = ",".join(cells)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))
    os.replace(tmp, path)
    return cells[1], path


def export(source: str, into: str, jobs: int) -> float:
    """`source`'s CSV files as the `parquet` format's files under `into` (the Parquet files alone)."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "msmon.launcher", "export", "-d", source, "--to", "parquet", "-o", into,
         "-j", str(jobs)],
        check=True, capture_output=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},
    )  # fmt: skip
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="where A and B are written (kept for reruns)")
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--copy", choices=("link", "copy"), default="link", help="how B is made from A")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="msmon diff -j")
    parser.add_argument("--format", choices=("csv", "parquet"), default="csv", help="the files compared")
    args = parser.parse_args()
    a, b = os.path.join(args.work, "a"), os.path.join(args.work, f"b-{args.copy}")
    rank, step, row = (args.ranks * 5) // 7, (args.steps * 3) // 5 + 1, 7
    made = {}
    if not os.path.isdir(a):
        made["write_a_s"] = round(write_a(a, args), 1)
    if os.path.isdir(b):
        shutil.rmtree(b)
    made["make_b_s"] = round(write_b(a, b, args.copy), 1)
    tensor, changed = change_one_value(b, rank, step, row)
    compared = (a, b)
    if args.format == "parquet":
        compared = (a + "-parquet", b + "-parquet")
        if not os.path.isdir(compared[0]):
            made["export_a_s"] = round(export(a, compared[0], args.jobs), 1)
        if os.path.isdir(compared[1]):
            shutil.rmtree(compared[1])
        made["export_b_s"] = round(export(b, compared[1], args.jobs), 1)
    answer = os.path.join(args.work, "diff.json")
    usage_file = os.path.join(args.work, "usage.json")
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", MEASURED, usage_file, "diff", *compared, "--json", answer, "-j", str(args.jobs)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},
    )  # fmt: skip
    wall = time.perf_counter() - started
    usage = json.loads(open(usage_file, encoding="utf-8").read())
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
    first = json.loads(open(answer, encoding="utf-8").read())["first_divergence"] if proc.returncode == 1 else None
    found = first is not None and (first["step"], first["name"], first["rank"], first["category"]) == (
        step, tensor, rank, CATEGORY,
    )  # fmt: skip
    print(
        json.dumps(
            {
                "ranks": args.ranks,
                "steps": args.steps,
                "tensors": args.tensors,
                "format": args.format,
                "files_per_side": len(glob.glob(os.path.join(a, "*-rank*", "*.csv")))
                if args.format == "csv"
                else len(glob.glob(os.path.join(compared[0], "parquet", "*", "*", "*.parquet"))),
                "b_made_by": args.copy,
                **made,
                "changed": {"file": changed, "step": step, "tensor": tensor, "rank": rank},
                "exit_code": proc.returncode,
                "found": found,
                "first_divergence": first,
                "diff_wall_s": round(wall, 1),
                **usage,
                "jobs": args.jobs,
                "load_average": os.getloadavg(),
            },
            indent=1,
        )
    )
    if not found:
        sys.exit(1)


if __name__ == "__main__":
    main()
