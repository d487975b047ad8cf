"""What the two runs are, side by side, before any value is compared: what differs between their
resolved configs, world sizes and parallel layouts, torch and device versions, parameter dtypes,
micro-batches per step, and the sets of tensors they recorded. Only a different model is refused
(Incomparable): most of the tensors one run records missing from the other."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .errors import Incomparable
from .layout import WHOLE_TENSOR
from .source import RunFacts
from .table import TensorKey

JOB_FACTS = (
    ("world_size", "world size"),
    ("parallel", "parallel groups"),
    ("optimizer_family", "optimizer family"),
    ("model", "model class"),
    ("param_dtypes", "parameter dtypes"),
    ("grad_acc_steps", "micro-batches per step"),
    ("device", "device"),
    ("torch", "torch"),
    ("python", "python"),
    ("msmon", "msmon"),
)
SAME_MODEL_SHARE = 0.5  # of the weights either run records, at least this share in common
CONFIG_LINES = 8


@dataclass
class Contract:
    same: list[str] = field(default_factory=list)  # "world size 2", ...
    differs: list[str] = field(default_factory=list)  # "torch: 2.13.0 against 2.12.1", ...
    unknown: list[str] = field(default_factory=list)  # facts a side does not state
    tensors: dict[str, dict[str, int]] = field(default_factory=dict)  # category -> common, only_a, only_b

    def to_json(self) -> dict[str, Any]:
        return {"same": self.same, "differs": self.differs, "unknown": self.unknown, "tensors": self.tensors}


def contract(a: RunFacts, b: RunFacts, tensors_a: set[TensorKey], tensors_b: set[TensorKey]) -> Contract:
    out = Contract()
    job_a, job_b = _first(a.jobs), _first(b.jobs)
    if not a.jobs or not b.jobs:
        missing = " and ".join(side for side, facts in (("A", a), ("B", b)) if not facts.jobs)
        out.unknown.append(
            f"{missing} state no job facts (no summary.json with them: msprobe's output, an older msmon, "
            "a job cut short)"
        )
    ranks_a, ranks_b = len(a.ranks), len(b.ranks)
    (out.same if ranks_a == ranks_b else out.differs).append(
        f"ranks with output: {ranks_a}" if ranks_a == ranks_b else f"ranks with output: {ranks_a} against {ranks_b}"
    )
    for key, words in JOB_FACTS:
        x, y = job_a.get(key), job_b.get(key)
        if key == "parallel":
            x, y = _groups(x), _groups(y)
        if x is None or y is None:
            continue
        if x == y:
            out.same.append(f"{words} {_text(x)}")
        else:
            out.differs.append(f"{words}: {_text(x)} against {_text(y)}")
    out.differs += _config_differences(_first(a.configs), _first(b.configs))
    categories = sorted({t[0] for t in tensors_a | tensors_b})
    for category in categories:
        in_a = {t for t in tensors_a if t[0] == category}
        in_b = {t for t in tensors_b if t[0] == category}
        out.tensors[category] = {"common": len(in_a & in_b), "only_a": len(in_a - in_b), "only_b": len(in_b - in_a)}
    return out


def check_same_model(tensors_a: set[TensorKey], tensors_b: set[TensorKey]) -> None:
    """Incomparable when the runs share no tensor, or when their weights are mostly not the same
    (the names of the whole-tensor categories both record)."""
    common = tensors_a & tensors_b
    if not common:
        raise Incomparable(
            f"A and B record no tensor in common ({len(tensors_a)} against {len(tensors_b)} tensors): a different "
            "model, or other names (--map names.json rewrites A's names into B's)"
        )
    both = {t[0] for t in tensors_a} & {t[0] for t in tensors_b} & WHOLE_TENSOR
    names_a = {t[2] for t in tensors_a if t[0] in both}
    names_b = {t[2] for t in tensors_b if t[0] in both}
    union = names_a | names_b
    if union and len(names_a & names_b) < SAME_MODEL_SHARE * len(union):
        raise Incomparable(
            f"A and B have different models: {len(names_a & names_b)} of {len(union)} weights in common "
            "(--map names.json rewrites A's names into B's)"
        )


def tensor_lines(contract: Contract) -> list[str]:
    """The recorded tensors, per category where the sets differ."""
    total: Counter = Counter()
    lines = []
    for category, counts in contract.tensors.items():
        total.update(counts)
        if counts["only_a"] or counts["only_b"]:
            lines.append(
                f"{category}: {counts['common']} in common, {counts['only_a']} only in A, {counts['only_b']} only in B"
            )
    head = f"tensors: {total['common']} in common"
    if total["only_a"] or total["only_b"]:
        head += f", {total['only_a']} only in A, {total['only_b']} only in B"
    return [head] + ["  " + line for line in lines]


def _first(by_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return by_rank[min(by_rank)] if by_rank else {}


def _groups(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k != "from"} or None
    return value


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(
            f"{k} {_text(v)}" if k in ("type", "name", "runtime") else f"{k}={_text(v)}" for k, v in value.items()
        )
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def _config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """`config KEY: x against y` for each resolved key that differs (the first few, then a count)."""
    if not a or not b:
        return []
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    lines = [f"config {k}: {_short(a.get(k))} against {_short(b.get(k))}" for k in keys[:CONFIG_LINES]]
    if len(keys) > CONFIG_LINES:
        lines.append(f"config: {len(keys) - CONFIG_LINES} more keys differ")
    return lines


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
