"""What the overhead benchmark runs: the models, the monitor configurations, one training step.

Shared by the msmon and the msprobe runs (it imports neither), so both tools see exactly the
same model, data and config.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tiny_gpt import TinyGPT, lm_loss, synthetic_batch  # noqa: E402

OPS = ["norm", "min", "max", "mean", "zeros", "nans"]  # msprobe's six ops


@dataclass(frozen=True)
class ModelSpec:
    vocab: int
    d_model: int
    n_layer: int
    n_head: int
    seq_len: int
    batch: int

    def build(self) -> torch.nn.Module:
        return TinyGPT(self.vocab, self.d_model, self.n_layer, self.n_head, self.seq_len)

    def batch_of(self, gen: torch.Generator, device: torch.device) -> torch.Tensor:
        return synthetic_batch(gen, self.batch, self.seq_len, self.vocab).to(device)


MODELS = {
    # the reference model of the core issue: 4 pre-LN blocks, d=256, vocab 1000, seq 64, batch 8
    "gpt-3.7M": ModelSpec(vocab=1000, d_model=256, n_layer=4, n_head=4, seq_len=64, batch=8),
    # the larger one, to see the trend with size: 8 blocks, d=768, seq 128
    "gpt-58M": ModelSpec(vocab=1000, d_model=768, n_layer=8, n_head=12, seq_len=128, batch=4),
    # a few kB of weights: the GPU script's dry run on the CPU exercises its code, not the machine
    "gpt-tiny": ModelSpec(vocab=64, d_model=32, n_layer=2, n_head=2, seq_len=16, batch=2),
}

CONFIGS: dict[str, dict[str, Any]] = {
    "wg": {"wg_distribution": True},
    # msmon's own keys (msprobe has neither): the loss per micro-step; the gradient agreement,
    # which needs data parallelism (benchmarks/loss_agreement_cost.py runs it on 2 DDP ranks)
    "wg+loss": {"wg_distribution": True, "loss_distribution": True},
    "wg+agreement": {"wg_distribution": True, "grad_agreement": True},
    "wg+mv+param": {"wg_distribution": True, "mv_distribution": True, "param_distribution": True},
    # an alert rule switches the non-finite origin on (a finiteness flag per module input and
    # output and per gradient of them); benchmarks/nan_origin_cost.py compares the two
    "wg+alerts": {"wg_distribution": True, "alert": {"rules": [{"rule_name": "AnomalyNan"}]}},
    "wg+alerts-origin": {
        "wg_distribution": True,
        "alert": {"rules": [{"rule_name": "AnomalyNan"}]},
        "nan_origin": False,
    },
    "all_xy": {"xy_distribution": True, "all_xy": True},
    "xy 10 of N": {"xy_distribution": True},  # targets filled in per model by xy_targets()
}


def leaf_modules(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if name and not list(m.children())]


def xy_targets(model: torch.nn.Module, count: int = 10) -> list[str]:
    """`count` leaf modules spread evenly over the model (msprobe's usual "some layers")."""
    leaves = leaf_modules(model)
    if len(leaves) <= count:
        return leaves
    step = len(leaves) / count
    return [leaves[int(i * step)] for i in range(count)]


def monitor_config(name: str, model: torch.nn.Module, ops: list[str] | None = None) -> dict[str, Any]:
    """The config file contents (msprobe keys, valid for both tools)."""
    config: dict[str, Any] = {"format": "csv", "ops": list(ops or OPS), **CONFIGS[name]}
    if name == "xy 10 of N":
        config["targets"] = {target: {} for target in xy_targets(model)}
    return config


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    """One ordinary optimizer step; the loss comes back detached (no host read here)."""
    loss = lm_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
