"""Compare what msmon wrote for megatron_gpt.py with the truth the script saved, and the losses
of the monitored run with those of the unmonitored one. Prints one line per check; exit 1 on any
failure."""

from __future__ import annotations

import csv
import glob
import json
import math
import sys

CATEGORIES = ("param_origin", "param_updated", "grad_reduced", "exp_avg", "exp_avg_sq")


def clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != "module")


def rows(directory: str, category: str) -> list[dict]:
    out: list[dict] = []
    for path in sorted(glob.glob(f"{directory}/{category}_[0-9]*.csv")):
        with open(path, newline="") as fh:
            out.extend(csv.DictReader(fh))
    return out


def main(plain: str, monitored: str, kind: str) -> int:
    failures = []
    truth = json.load(open(f"{monitored}/truth_rank0.json"))
    base = json.load(open(f"{plain}/truth_rank0.json"))
    expected_class = {"distributed": "DistributedOptimizer", "float16": "Float16OptimizerWithFloat16Params"}[kind]
    if truth["optimizer"] != expected_class:
        failures.append(f"optimizer is {truth['optimizer']}, expected {expected_class}")
    if truth["losses"] != base["losses"]:
        failures.append(f"losses differ with monitoring: {truth['losses']} vs {base['losses']}")
    dirs = [d for d in glob.glob(f"{monitored}/out/*-rank0-*") if rows(d, "param_updated")]
    if len(dirs) != 1:
        failures.append(f"expected one rank-0 output with rows, found {dirs}")
    else:
        for category in CATEGORIES:
            expected = {(s, clean(n)): v for s, step in enumerate(truth["steps"]) for n, v in step[category].items()}
            got = {(int(r["step"]), r["name"]): r for r in rows(dirs[0], category)}
            if set(got) != set(expected):
                failures.append(f"{category}: rows {sorted(set(got) ^ set(expected))[:5]} differ from the truth")
                continue
            worst = 0.0
            for key, ref in expected.items():
                scale = max(abs(ref["min"]), abs(ref["max"]), 1e-30)
                for op, value in ref.items():
                    value_got = float(got[key][op])
                    err = abs(value_got - value) / (scale if op == "mean" else max(abs(value), 1e-30))
                    if not (math.isnan(value) and math.isnan(value_got)):
                        worst = max(worst, err if abs(value_got - value) > 1e-10 else 0.0)
            status = "ok" if worst < 1e-4 else "FAIL"
            print(f"{kind} {category}: {len(got)} rows, worst relative error {worst:.2e} {status}")
            if status != "ok":
                failures.append(f"{category}: worst relative error {worst:.2e}")
        if not rows(dirs[0], "grad_unreduced"):
            failures.append("no grad_unreduced rows (bucket grad sync not seen)")
    for failure in failures:
        print(f"{kind} FAIL: {failure}")
    print(f"{kind}: {'PASS' if not failures else 'FAIL'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
