"""Small monitor outputs written by hand for `msmon diff`'s unit tests: msmon's CSV layout (one
file per category and step, `{time}-rank{r}-{uid}/`), with run.json, config.json and a
summary.json whose "job" says the layout, or none of them (msprobe's output)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from msmon.records.runs import write_run_file

OPS = ("norm", "min", "max", "mean")
# category -> tensor names, in the order a step records them
TENSORS = {
    "param_origin": ["fc1.weight", "fc2.weight"],
    "actv": ["fc1.input", "fc1.output", "fc2.input", "fc2.output"],
    "actv_grad": ["fc2.output_grad", "fc2.input_grad", "fc1.output_grad", "fc1.input_grad"],
    "grad_unreduced": ["fc1.weight", "fc2.weight"],
    "grad_reduced": ["fc1.weight", "fc2.weight"],
    "exp_avg": ["fc1.weight", "fc2.weight"],
    "param_updated": ["fc1.weight", "fc2.weight"],
}
MICRO = ("actv", "actv_grad")
Value = Callable[[str, str, int, int, int], float]  # (category, name, step, rank, micro) -> norm


def base_value(category: str, name: str, step: int, rank: int, micro: int) -> float:
    """A norm that differs by tensor, step and (for rank-local categories) rank and micro-step."""
    local = category in ("actv", "actv_grad", "grad_unreduced")
    seed = sum(map(ord, category + name)) + 7 * step + (13 * rank + 5 * micro if local else 0)
    return 0.5 + (seed % 97) / 31.0


def row_values(norm: float) -> list[float]:
    return [norm, -norm / 40, norm / 38, norm / 1000]


def cell(value: float) -> str:
    return repr(round(value, 6)) if abs(value) >= 1 else repr(float(f"{value:.6g}"))


def write_output(
    root: Path,
    ranks: int = 2,
    steps: int = 3,
    micro_steps: int = 1,
    value: Value = base_value,
    run_id: str | None = "20261206-100000-aaaaaa",
    job: dict | None = None,
    msprobe: bool = False,
    time: str = "Dec06_10-00-00",
    blocks: int = 0,
) -> Path:
    """One run's output under `root`; `job`: summary.json's "job" (None: a plain DDP job's);
    `blocks`: that many more modules' outputs (`blocks.{i}.output`) among the activations."""
    tensors = {**TENSORS, "actv": TENSORS["actv"] + [f"blocks.{i}.output" for i in range(blocks)]}
    for rank in range(ranks):
        rank_dir = root / f"{time}-rank{rank}-{abs(hash((root, rank, time))) % 10**8:08d}"
        rank_dir.mkdir(parents=True)
        for step in range(steps):
            for category, names in tensors.items():
                micro = category in MICRO
                header = ["vpp_stage", "name", "step"] + (["micro_step"] if micro else []) + list(OPS)
                lines = [",".join(header)]
                for m in range(micro_steps if micro else 1):
                    for name in names:
                        values = row_values(value(category, name, step, rank, m))
                        lines.append(f"0,{name},{step}," + (f"{m}," if micro else "") + ",".join(map(cell, values)))
                (rank_dir / f"{category}_{step}-{step}.csv").write_text("\n".join(lines) + "\n")
        if msprobe:
            continue
        facts = {"world_size": ranks, "parallel": {"from": "none"}, "param_dtypes": {"float32": 2}}
        facts["grad_acc_steps"] = micro_steps
        (rank_dir / "config.json").write_text(json.dumps({"ops": list(OPS), "format": ["csv"], "ndigits": 6}))
        summary = {"rank": rank, "steps_recorded": steps, "job": job if job is not None else facts}
        (rank_dir / "summary.json").write_text(json.dumps(summary))
        if run_id:
            write_run_file(str(rank_dir), run_id, rank)
    return root


def changed(category: str, name: str, step: int, rank: int | None = None, factor: float = 1.001) -> Value:
    """`base_value` with one tensor's norm times `factor` from `step` on (on `rank`, or every rank)."""

    def value(c: str, n: str, s: int, r: int, m: int) -> float:
        base = base_value(c, n, s, r, m)
        hit = c == category and n == name and s >= step and (rank is None or r == rank)
        return base * factor if hit else base

    return value
