"""Fingerprints of the same tensors from every rank of the group, compared: which ranks hold
the majority copy and which differ."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .entries import NO_GRAD, Entry, ranks_text


@dataclass
class Mismatch:
    """One tensor whose fingerprints differ across the group."""

    entry: Entry
    differing: list[int]  # global ranks whose copy differs from the majority (all, without one)
    majority: list[int]  # global ranks holding the majority copy (empty: no majority)
    values: dict[int, int]  # global rank -> fingerprint

    def describe(self) -> str:
        what = f"{self.entry.label} ({self.entry.what})"
        if self.majority:
            verb = "differs" if len(self.differing) == 1 else "differ"
            text = f"{what}: {ranks_text(self.differing)} {verb} from the majority ({ranks_text(self.majority)})"
        else:
            copies = " vs ".join("{" + ", ".join(map(str, g)) + "}" for g in _copies(self.values))
            text = (
                f"{what}: {ranks_text(self.differing)} hold different copies and none has a majority (copies {copies})"
            )
        missing = [r for r, v in self.values.items() if v == NO_GRAD]
        if missing:
            text += f"; {ranks_text(missing)} {'has' if len(missing) == 1 else 'have'} no gradient"
        return text


def compare(table: torch.Tensor, ranks: list[int], entries: list[Entry]) -> list[Mismatch]:
    """The tensors whose fingerprints differ: `table` is int64 [ranks, tensors] on the host (row i
    from ranks[i]). The majority copy is the one more than half the ranks hold; without one,
    every rank is named."""
    out: list[Mismatch] = []
    if table.shape[0] < 2:
        return out
    for j in (table != table[0]).any(dim=0).nonzero().flatten().tolist():
        column = table[:, j].tolist()
        by_rank = dict(zip(ranks, column))
        top, count = max(((v, column.count(v)) for v in set(column)), key=lambda item: item[1])
        if count * 2 > len(ranks):
            majority = [r for r, v in by_rank.items() if v == top]
            differing = [r for r in ranks if r not in majority]
        else:
            majority, differing = [], list(ranks)
        out.append(Mismatch(entries[j], differing, majority, by_rank))
    return out


def _copies(values: dict[int, int]) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return sorted(groups.values())
