"""Two gloo ranks driving `ConfigAgreement` round by round, as a monitor does at each step end:
on even steps the number travels in a gather of its own payload (standing in for the shard
gather), on odd steps the agreement sends it itself. Each scenario lists, per rank, the steps
at which the rank reads a (named) edit; the script writes which config each rank applied at
which step, to agreed_rank<r>.json."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from msmon.config import parse_config
from msmon.runtime.agreement import ConfigAgreement
from msmon.system import lifecycle

CONFIGS = {
    name: parse_config({"ops": ops}) for name, ops in {"B": ["norm", "max"], "C": ["min"], "D": ["mean"]}.items()
}
SCENARIOS = {  # name -> {rank: {step: config read}}
    "read-at-different-steps": {0: {2: "B"}, 1: {4: "B"}},
    "a-newer-edit-wins": {0: {1: "B", 3: "C"}, 1: {6: "C"}},
    "read-together-applied-once": {0: {0: "D"}, 1: {0: "D"}},
    "saved-again-applied-again": {0: {0: "D", 5: "D"}, 1: {0: "D", 5: "D"}},
    "never-read-by-one-rank": {0: {1: "B"}, 1: {}},
}
STEPS = 12


def run(scenario: dict[int, dict[int, str]], rank: int) -> list[list]:
    agreement = ConfigAgreement([dist.group.WORLD], rank)
    applied = []
    for step in range(STEPS):
        stamped = {}
        if step % 2 == 0:  # a recorded step: the shard gather carries the number in front
            payload = torch.tensor([agreement.stamp(), float(step)], dtype=torch.float64)
            parts = [torch.empty_like(payload) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, payload)
            stamped[id(dist.group.WORLD)] = torch.stack(parts)[:, 0]
        agreement.end_round(stamped)
        read = scenario[rank].get(step)
        if read is not None:
            agreement.propose(CONFIGS[read])
        agreed = agreement.decide()
        if agreed is not None:
            applied.append([step, next(n for n, c in CONFIGS.items() if c is agreed)])
    return applied


def main() -> None:
    lifecycle.setup_logging()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {name: run(scenario, rank) for name, scenario in SCENARIOS.items()}
    dist.barrier()
    with open(os.path.join(sys.argv[1], f"agreed_rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
