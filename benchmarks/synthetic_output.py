"""A synthetic monitor output in msmon's layout, to measure `msmon db`, `msmon report` and
`msmon analyse` at scale without training anything.

    PYTHONPATH=src python benchmarks/synthetic_output.py -o /tmp/synthetic --ranks 512 --steps 200
    PYTHONPATH=src python benchmarks/synthetic_output.py -o /tmp/small --ranks 4 --steps 12 --tensors 20

What it writes, per rank, is what a CSV-format monitor writes (csv_sink.CsvSink's layout):
`<time>-rank<r>-<uid>/{category}_{first}-{last}.csv` with the header
`vpp_stage,name,step[,micro_step],norm,min,max,mean,zeros,nans,infs`, values written as
`repr(round(v, 6))`, one file per category and `--window` steps (msmon's default
step_count_per_record is 1), plus config.json and summary.json. `--tensors` rows per step are
spread evenly over five categories: activations (actv, with a micro_step column) and
grad_unreduced (different on every rank), grad_reduced, exp_avg and exp_avg_sq (replicated:
the same on every data-parallel rank).

Three things happen in it, so a report has something to show:
- a spike: at 60 % of the run one rank's unreduced gradient of one layer grows 50x
  (AnomalyTurbulence is dumped for it);
- a desync: from half-way one rank's replicated tensors drift by 1e-3 (no alert, only the
  report's rank spread shows it);
- non-finite values: at 80 % of the run one rank's activation of a middle layer turns NaN,
  and every later layer and, on every rank, the reduced gradients follow (NanOrigin and
  AnomalyNan records, written with msmon's own AnomalyDumpWriter).

With `--loss`, each rank also has the loss files a `loss_distribution` monitor writes
(`loss_{first}-{last}.csv`, header `vpp_stage,name,step,micro_step,value`, the row `loss`, one
per micro-step, `--micro-steps` of them): a falling curve, a little different on every rank,
NaN on the NaN rank from the NaN step on. With `--bad-data`, from 40 % of the run one rank is
fed bad batches: its loss is 3x, its unreduced gradients 4x and its activations 2x the other
ranks' (no NaN), while its replicated tensors stay the same as everyone's; its dump has the
AnomalyRankOutlier record the rank-outlier rule writes at that step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from multiprocessing import Pool

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from msmon.anomaly.dump import AnomalyDumpWriter  # noqa: E402

OPS = ("norm", "min", "max", "mean", "zeros", "nans", "infs")
CATEGORIES = ("actv", "grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq")
PER_RANK = ("actv", "grad_unreduced")
LOSS = "loss"  # the category, and the row's name, of the loss (loss_distribution)
SCALE = {"actv": 30.0, "grad_unreduced": 0.1, "grad_reduced": 0.1, "exp_avg": 0.01, "exp_avg_sq": 1e-3}


def names(category: str, count: int) -> list[str]:
    """`count` tensor names of a category: module outputs for activations, weights otherwise."""
    kinds = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    out = []
    for i in range(count):
        layer, kind = divmod(i, len(kinds))
        base = f"layers.{layer}.{kinds[kind]}"
        out.append(f"{base}.output" if category == "actv" else f"{base}.weight")
    return out


def noise(*key: int) -> float:
    """A deterministic number in [-1, 1) from integers (cheap, no random state to carry)."""
    h = 0x9E3779B97F4A7C15
    for k in key:
        h = ((h ^ (k + 0x632BE59BD9B4E019)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 31
    return (h & 0xFFFFFF) / float(1 << 23) - 1.0


class Plan:
    """Where the spike, the desync and the NaN happen, the same in every worker process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.ranks, self.steps = args.ranks, args.steps
        self.per_category = max(1, args.tensors // len(CATEGORIES))
        self.window = args.window
        self.format, self.roll = args.format, args.roll
        self.spike_step, self.spike_rank, self.spike_tensor = (
            int(self.steps * 0.6),
            self.ranks // 2,
            self.per_category // 3,
        )
        self.desync_step, self.desync_rank = self.steps // 2, self.ranks // 3
        self.nan_step, self.nan_rank, self.nan_tensor = (
            int(self.steps * 0.8),
            (self.ranks * 3) // 4,
            self.per_category // 2,
        )
        self.names = {c: names(c, self.per_category) for c in CATEGORIES}
        self.loss, self.micro_steps = args.loss, args.micro_steps
        self.bad_step = int(self.steps * 0.4) if args.bad_data else self.steps + 1
        self.bad_rank = self.ranks // 4
        self.bad_factor = {"actv": 2.0, "grad_unreduced": 4.0, LOSS: 3.0}

    def norm(self, category: str, rank: int, i: int, step: int) -> float:
        layer_scale = 10.0 ** (2.0 * i / max(1, self.per_category - 1) - 1.0)
        trend = 1.0 + 0.5 * math.sin(step / max(1, self.steps) * math.pi)
        who = rank if category in PER_RANK else 0
        value = SCALE[category] * layer_scale * trend * (1.0 + 0.05 * noise(who, i, step, len(category)))
        if (
            category == "grad_unreduced"
            and rank == self.spike_rank
            and i == self.spike_tensor
            and step == self.spike_step
        ):
            value *= 50.0
        if category in PER_RANK and rank == self.bad_rank and step >= self.bad_step:
            value *= self.bad_factor[category]
        if category not in PER_RANK and rank == self.desync_rank and step >= self.desync_step:
            value *= 1.001
        return value

    def loss_value(self, rank: int, step: int, micro: int) -> float:
        """The loss of one micro-step: falling over the run, 3 % apart across ranks."""
        if rank == self.nan_rank and step >= self.nan_step:
            return math.nan
        value = (2.5 * math.exp(-3.0 * step / max(1, self.steps)) + 0.3) * (1.0 + 0.03 * noise(rank, step, micro, 9))
        return value * (self.bad_factor[LOSS] if rank == self.bad_rank and step >= self.bad_step else 1.0)

    def nonfinite(self, category: str, rank: int, i: int, step: int) -> bool:
        if step < self.nan_step:
            return False
        if category == "actv":
            return rank == self.nan_rank and i >= self.nan_tensor
        return category in ("grad_reduced", "exp_avg", "exp_avg_sq")


def _row(plan: Plan, category: str, rank: int, i: int, step: int) -> list[float]:
    if plan.nonfinite(category, rank, i, step):
        return [math.nan, math.nan, math.nan, math.nan, 0.0, 1.0, 0.0]
    n = plan.norm(category, rank, i, step)
    who = rank if category in PER_RANK else 0
    return [n, -n / 40.0, n / 38.0, n * 1e-2 * noise(who, i, step), 0.0, 0.0, 0.0]


def _cells(values: list[float]) -> str:
    return ",".join(repr(round(v, 6)) for v in values)


def write_rank(job: tuple[Plan, str, int]) -> tuple[int, int]:
    """One rank's directory (and Parquet files); returns the number of rows and of values written."""
    plan, out, rank = job
    rank_dir = os.path.join(out, f"Dec03_16-40-51-rank{rank}-{int((noise(rank, 7) + 1.0) * 2**31):08x}")
    os.makedirs(rank_dir, exist_ok=True)
    if plan.format == "parquet":
        rows, values = write_parquet(plan, out, rank)
    else:
        rows, values = write_csv(plan, rank_dir, rank)
    config = {
        "targets": {},
        "loss_distribution": plan.loss,
        "wg_distribution": True,
        "mv_distribution": True,
        "xy_distribution": True,
        "format": [plan.format],
        "ops": list(OPS),
        "step_count_per_record": plan.window,
        "parquet_roll_steps": plan.roll,
        "alert": {
            "rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 3.0}}, {"rule_name": "AnomalyNan"}],
            "dump": True,
        },
    }
    with open(os.path.join(rank_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    step_ms = 950.0 * (1.0 + 0.02 * noise(rank, 1))
    cost_ms = 25.0 * (1.0 + 0.2 * noise(rank, 2)) + (40.0 if rank == plan.spike_rank else 0.0)
    alerts = write_anomalies(plan, out, rank)
    summary = {
        "rank": rank,
        "output_dir": rank_dir,
        "steps_recorded": plan.steps,
        "alerts": alerts,
        "first_nonfinite": None,
        "monitor_seconds": round(cost_ms * plan.steps / 1000, 6),
        "steps_timed": plan.steps - 1,
        "step_ms": round(step_ms, 3),
        "monitor_ms_per_step": round(cost_ms, 3),
        "monitor_cost_pct": round(100 * cost_ms / step_ms, 3),
        "writer_cpu_seconds": round(0.003 * plan.steps, 6),
        "writer_cpu_ms_per_step": 3.0,
        "last_step": plan.steps,
    }
    with open(os.path.join(rank_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
    return rows, values


def write_csv(plan: Plan, rank_dir: str, rank: int) -> tuple[int, int]:
    """The rank's CSV files, as the CSV sink lays them out."""
    rows = 0
    for category in CATEGORIES:
        micro = category == "actv"
        header = ",".join(["vpp_stage", "name", "step"] + (["micro_step"] if micro else []) + list(OPS))
        for first in range(0, plan.steps, plan.window):
            last = first + plan.window - 1
            lines = [header]
            for step in range(first, min(last + 1, plan.steps)):
                for i, name in enumerate(plan.names[category]):
                    lines.append(
                        f"0,{name},{step}," + ("0," if micro else "") + _cells(_row(plan, category, rank, i, step))
                    )
                    rows += 1
            with open(os.path.join(rank_dir, f"{category}_{first}-{last}.csv"), "w", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")
    values = rows * len(OPS)
    if plan.loss:
        loss_rows = write_loss(plan, rank_dir, rank)
        rows, values = rows + loss_rows, values + loss_rows
    return rows, values


def write_parquet(plan: Plan, out: str, rank: int) -> tuple[int, int]:
    """The rank's rows through the Parquet sink, step after step as a monitor hands them over."""
    import torch

    from msmon.output.sinks.parquet_sink import ParquetSink
    from msmon.records.rows import RowKey, StepRecord
    from msmon.records.runs import NO_RUN

    sink = ParquetSink(os.path.abspath(out), NO_RUN, 6, plan.roll, 128 << 20)
    keys = [
        RowKey(category, name, 0, 0 if category == "actv" else None)
        for category in CATEGORIES
        for name in plan.names[category]
    ]
    loss_keys = [RowKey(LOSS, LOSS, 0, micro) for micro in range(plan.micro_steps)]
    rows = values = 0
    for step in range(plan.steps):
        table = [_row(plan, key.category, rank, i % plan.per_category, step) for i, key in enumerate(keys)]
        sink.write(StepRecord(step, rank, list(OPS), keys, table=torch.tensor(table, dtype=torch.float64)))
        rows, values = rows + len(keys), values + len(keys) * len(OPS)
        if plan.loss:
            loss = [[plan.loss_value(rank, step, micro)] for micro in range(plan.micro_steps)]
            sink.write(StepRecord(step, rank, ["value"], loss_keys, table=torch.tensor(loss, dtype=torch.float64)))
            rows, values = rows + len(loss_keys), values + len(loss_keys)
    sink.close()
    return rows, values


def write_loss(plan: Plan, rank_dir: str, rank: int) -> int:
    """The rank's loss files: one row per micro-step, `--window` steps per file."""
    rows = 0
    for first in range(0, plan.steps, plan.window):
        last = first + plan.window - 1
        lines = ["vpp_stage,name,step,micro_step,value"]
        for step in range(first, min(last + 1, plan.steps)):
            for micro in range(plan.micro_steps):
                lines.append(f"0,{LOSS},{step},{micro},{_cells([plan.loss_value(rank, step, micro)])}")
                rows += 1
        with open(os.path.join(rank_dir, f"{LOSS}_{first}-{last}.csv"), "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
    return rows


def write_anomalies(plan: Plan, out: str, rank: int) -> int:
    """The dump records the rules would have written for this rank; returns how many."""
    records: list[dict] = []
    if rank == plan.bad_rank and plan.bad_step < plan.steps:  # the rank-outlier rule's record
        value, others = plan.norm("actv", rank, 0, plan.bad_step), plan.norm("actv", 0, 0, plan.bad_step)
        records.append(
            {
                "step": plan.bad_step,
                "micro_step": 0,
                "stage": "forward",
                "call_id": 0,
                "name": plan.names["actv"][0],
                "category": "actv",
                "op": "norm",
                "value": value,
                "history": others,
                "rule": "AnomalyRankOutlier",
                "message": f"rank {rank}'s activation norm {value:.6g} departs from the ranks' median {others:.6g}",
            }
        )
    if rank == plan.spike_rank:
        i = plan.spike_tensor
        records.append(
            {
                "step": plan.spike_step,
                "stage": "backward",
                "call_id": 100 + i,
                "name": plan.names["grad_unreduced"][i],
                "category": "grad_unreduced",
                "op": "norm",
                "value": plan.norm("grad_unreduced", rank, i, plan.spike_step),
                "history": plan.norm("grad_unreduced", rank, i, plan.spike_step) / 50.0,
                "rule": "AnomalyTurbulence",
                "message": "norm grew 50x its history",
            }
        )
    if plan.nan_step < plan.steps:
        step = plan.nan_step
        if rank == plan.nan_rank:
            first = plan.names["actv"][plan.nan_tensor]
            records.append(
                {
                    "step": step,
                    "micro_step": 0,
                    "stage": "forward",
                    "call_id": plan.nan_tensor,
                    "name": first,
                    "category": "actv",
                    "op": "nans",
                    "value": 1.0,
                    "rule": "NanOrigin",
                    "message": "first non-finite output",
                }
            )
            for i in range(plan.nan_tensor, plan.per_category):
                records.append(
                    {
                        "step": step,
                        "micro_step": 0,
                        "stage": "forward",
                        "call_id": i,
                        "name": plan.names["actv"][i],
                        "category": "actv",
                        "op": "norm",
                        "value": math.nan,
                        "rule": "AnomalyNan",
                        "message": "norm is nan",
                    }
                )
        for i, name in enumerate(plan.names["grad_reduced"]):
            records.append(
                {
                    "step": step,
                    "stage": "optimizer",
                    "call_id": 1000 + i,
                    "name": name,
                    "category": "grad_reduced",
                    "op": "norm",
                    "value": math.nan,
                    "rule": "AnomalyNan",
                    "message": "norm is nan",
                }
            )
    if records:
        AnomalyDumpWriter(out, rank, 0, list(range(plan.ranks))[:8]).append(records)
    return len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", required=True, help="the output directory (MONITOR_OUTPUT_DIR) to write")
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tensors", type=int, default=200, help="rows per rank and step, over five categories")
    parser.add_argument("--window", type=int, default=1, help="steps per CSV file (step_count_per_record)")
    parser.add_argument(
        "--format", choices=("csv", "parquet"), default="csv", help="the CSV layout, or the Parquet sink's"
    )
    parser.add_argument("--roll", type=int, default=50, help="steps per Parquet file (parquet_roll_steps)")
    parser.add_argument("--loss", action="store_true", help="also the loss files (loss_distribution)")
    parser.add_argument("--micro-steps", type=int, default=1, help="loss rows per step (with --loss)")
    parser.add_argument("--bad-data", action="store_true", help="one rank fed bad batches from 40 %% of the run")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    plan = Plan(args)
    started = time.perf_counter()
    jobs = [(plan, args.output, rank) for rank in range(args.ranks)]
    with Pool(args.processes) as pool:
        counts = list(pool.imap_unordered(write_rank, jobs, chunksize=1))
    rows, values = sum(c[0] for c in counts), sum(c[1] for c in counts)
    print(
        json.dumps(
            {
                "output": args.output,
                "ranks": args.ranks,
                "steps": args.steps,
                "rows_per_step": plan.per_category * len(CATEGORIES),
                "csv_rows": rows,
                "values": values,
                "files": args.ranks
                * (
                    math.ceil(args.steps / args.roll)
                    if args.format == "parquet"
                    else (len(CATEGORIES) + plan.loss) * math.ceil(args.steps / args.window)
                ),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
