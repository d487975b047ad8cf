"""`msmon db` + `msmon report` on the synthetic output written as CSV and through the Parquet sink,
with the file count and what a rank killed mid-write leaves (issue 44's targets).

    PYTHONPATH=src python benchmarks/parquet_scale.py --work /tmp/scale             # 512 x 200 x 200
    PYTHONPATH=src python benchmarks/parquet_scale.py --work /tmp/small --ranks 8 --steps 20 --tensors 50
    PYTHONPATH=src python benchmarks/parquet_scale.py --outputs /tmp/scale --work /tmp/again   # reuse them

It writes (unless already there) `WORK/csv` with synthetic_output.py's CSV layout (a file per
category and step, msmon's default) and `WORK/parquet` with the same rows through msmon's own
ParquetSink (`--roll` steps per file: parquet_roll_steps' default, 100), then times, for each,
a fresh `msmon db` and `msmon report --db` as child processes (wall time, and peak RSS from
wait4), and prints one JSON object. With `--outputs DIR`, the two outputs are read from
`DIR/csv` and `DIR/parquet` (made earlier with the same --ranks, --steps, --tensors and
--roll, which the result reports; never written to), and only the databases, pages and the
kill test's files go to `--work`.

- `files`: the Parquet files written, against the bound ranks x ceil(steps / roll);
- `csv`, `parquet`: wall seconds, CPU seconds and peak RSS of db, report and both; `speedup`:
  csv / parquet wall time of db + report (the target is at least 5; `cpu_speedup` the same in
  CPU time), `peak_ratio`: parquet / csv peak RSS (the target: at most 1);
- `kill`: a process writing one more rank's steps through the sink
  (tests/scripts/parquet_writer_killed.py: a file every 3 steps, a row group every step) killed
  with SIGKILL while it writes row groups into its third file: every visible `*.parquet` file
  read back whole with pyarrow and DuckDB, and the open file left as a hidden `.tmp` that
  neither reads.

The timings mean something only on a quiet machine: run it alone, and say which machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, SRC)

from msmon.config.schema import MonitorConfig  # noqa: E402
from msmon.records.parquet_layout import PARQUET_DIR, PARQUET_FILE, UNFINISHED_FILE  # noqa: E402

KILLED_WRITER = os.path.join(os.path.dirname(HERE), "tests", "scripts", "parquet_writer_killed.py")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}


def generate(args: argparse.Namespace, out: str, fmt: str) -> None:
    if os.path.isdir(out):
        return
    argv = [sys.executable, os.path.join(HERE, "synthetic_output.py"), "-o", out, "--ranks", str(args.ranks)]
    argv += ["--steps", str(args.steps), "--tensors", str(args.tensors), "--format", fmt, "--roll", str(args.roll)]
    subprocess.run(argv, check=True, env=_env())


def timed(argv: list[str]) -> dict[str, float]:
    """Wall seconds and peak RSS (MiB) of one child process."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{stderr[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime  # what a busy machine inflates less than the wall time
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2), "peak_mib": round(usage.ru_maxrss / 1024, 1)}


def db_and_report(output: str, work: str, name: str) -> dict[str, dict[str, float]]:
    database, page = os.path.join(work, f"{name}.duckdb"), os.path.join(work, f"{name}.html")
    for path in (database, database + ".wal"):
        if os.path.exists(path):
            os.remove(path)
    msmon = [sys.executable, "-m", "msmon.launcher"]
    db = timed([*msmon, "db", "-d", output, "-o", database, "--no-progress"])
    report = timed([*msmon, "report", "--db", database, "-o", page])
    both = {key: round(db[key] + report[key], 2) for key in ("seconds", "cpu_seconds")}
    both["peak_mib"] = max(db["peak_mib"], report["peak_mib"])
    return {"db": db, "report": report, "both": both}


def kill_mid_write(work: str) -> dict[str, object]:
    """SIGKILL a rank while it writes row groups into an open file; then read every visible file back."""
    import duckdb
    import pyarrow.parquet as pq

    base = os.path.join(work, "killed")
    shutil.rmtree(base, ignore_errors=True)  # a rerun in the same --work counts only its own files
    proc = subprocess.Popen([sys.executable, KILLED_WRITER, base, "7"], env=_env(), stdout=subprocess.PIPE)
    try:
        ready = proc.stdout.readline() if proc.stdout else b""  # two files closed, the third open
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    visible = sorted(os.path.join(d, n) for d, _, names in os.walk(base) for n in names if n.endswith(".parquet"))
    rows = {p: pq.read_table(p).num_rows for p in visible}
    pattern = os.path.join(base, PARQUET_DIR, "*", "*", "*.parquet")
    total = duckdb.connect().execute("SELECT count(*) FROM read_parquet(?)", [pattern]).fetchone()[0]
    leftovers = sorted(os.path.join(d, n) for d, _, names in os.walk(base) for n in names if UNFINISHED_FILE.match(n))
    unreadable = 0
    for path in leftovers:
        try:
            pq.read_table(path)
        except Exception:
            unreadable += 1
    return {
        "killed_mid_file": ready == b"open\n" and proc.returncode == -signal.SIGKILL,
        "visible_files": len(visible),
        "all_read": total == sum(rows.values()) and all(n > 0 for n in rows.values()),
        "rows": total,
        "unfinished_left": len(leftovers),
        "unfinished_unreadable": unreadable,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--work",
        required=True,
        help="the folder for the databases, pages and kill test (and both outputs unless --outputs)",
    )
    parser.add_argument(
        "--outputs",
        help="a folder with csv/ and parquet/ outputs made earlier (read only): reuse them instead of writing them",
    )
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument(
        "--roll",
        type=int,
        default=MonitorConfig().parquet_roll_steps,
        help="steps per Parquet file (parquet_roll_steps)",
    )
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    outputs = args.outputs or args.work
    csv_out, parquet_out = os.path.join(outputs, "csv"), os.path.join(outputs, "parquet")
    if args.outputs:
        for out in (csv_out, parquet_out):
            if not os.path.isdir(out):
                raise SystemExit(f"--outputs: no {out}")
    else:
        generate(args, csv_out, "csv")
        generate(args, parquet_out, "parquet")
    files = sum(1 for _, _, names in os.walk(parquet_out) for n in names if PARQUET_FILE.match(n))
    bound = args.ranks * math.ceil(args.steps / args.roll)
    csv = db_and_report(csv_out, args.work, "csv")
    parquet = db_and_report(parquet_out, args.work, "parquet")
    result = {
        "ranks": args.ranks,
        "steps": args.steps,
        "tensors": args.tensors,
        "roll": args.roll,
        "files": {"parquet": files, "bound": bound, "within": files <= bound},
        "csv": csv,
        "parquet": parquet,
        "speedup": round(csv["both"]["seconds"] / parquet["both"]["seconds"], 2),
        "cpu_speedup": round(csv["both"]["cpu_seconds"] / parquet["both"]["cpu_seconds"], 2),
        "peak_ratio": round(parquet["both"]["peak_mib"] / csv["both"]["peak_mib"], 2),
        "kill": kill_mid_write(args.work),
        "outputs": os.path.abspath(outputs),
        "load": os.getloadavg(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
