"""What the native statistics cost at a monitor's first start: the compile (wall, CPU, the
compiler's peak memory) and native.prepare() at attach with the kernel already in the cache.

    python benchmarks/native_first_use.py [--repeats 5] [--json out.json]

Each measurement runs in a fresh process with its own empty cache directory, so nothing is
shared between them; the compiler's CPU time and peak RSS come from getrusage(RUSAGE_CHILDREN).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ONE_START = r"""
import json, os, resource, sys, time
from msmon.stats import native  # imports torch: not counted
start = time.perf_counter()
native.prepare()
took = time.perf_counter() - start
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"prepare_s": took, "compiled": native.compiled_here, "compile_s": native.build_seconds,
                  "isa": native.isa(), "children_cpu_s": kids.ru_utime + kids.ru_stime}))
"""
# the compiler's peak memory, from a small process: a child's maxrss counts its parent's memory
# up to the exec, which in a process with torch loaded is torch's
COMPILER_PEAK = r"""
import importlib.util, json, resource, sys, tempfile, os
spec = importlib.util.spec_from_file_location("build", sys.argv[1])
build = sys.modules["build"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
with tempfile.TemporaryDirectory() as d:
    build._compile(build.compiler(), open(build.SOURCE, "rb").read(), os.path.join(d, "k.so"))
print(json.dumps(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024))
"""
BUILD_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "msmon", "native", "build.py")


def start(cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MSMON_NATIVE_STATS"}  # the default: auto
    env["MSMON_CACHE_DIR"] = cache
    out = subprocess.run([sys.executable, "-c", ONE_START], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    cold, warm = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(start(cache))  # empty cache: compiles
            warm.append(start(cache))  # the next start: loads
    assert all(c["compiled"] for c in cold) and not any(w["compiled"] for w in warm)

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    record = {
        "date": time.strftime("%Y-%m-%d"),
        "load_average": os.getloadavg(),
        "isa": cold[0]["isa"],
        "compiler": subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[0],
        "compile_wall_s_median": med(cold, "compile_s"),
        "compile_wall_s": [c["compile_s"] for c in cold],
        "compile_cpu_s_median": med(cold, "children_cpu_s"),
        "compiler_peak_rss_mib": json.loads(
            subprocess.run(
                [sys.executable, "-S", "-c", COMPILER_PEAK, BUILD_PY], capture_output=True, text=True, check=True
            ).stdout
        ),
        "first_prepare_s_median": med(cold, "prepare_s"),
        "cached_prepare_s_median": med(warm, "prepare_s"),
        "cached_prepare_s": [w["prepare_s"] for w in warm],
    }
    print(json.dumps(record, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(record, fh, indent=2)


if __name__ == "__main__":
    main()
