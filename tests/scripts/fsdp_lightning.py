"""An ordinary Lightning script with FSDP2: `ModelParallelStrategy` (data-parallel only), the
model sharded with `fully_shard` in `configure_model`, Adam built in `configure_optimizers`
over the sharded parameters. No monitoring code. Saves the whole weights after every step
(`full_tensor()`), as the truth. (Lightning's `strategy="fsdp"` is FSDP1 and refuses a CPU
accelerator; this strategy runs on CPU.)

With `--clip`, `gradient_clip_val=1.0` and a loss large enough to be clipped every step:
Lightning clips (`clip_grad_norm_` over the DTensor gradients) inside the closure it hands to
`Adam.step(closure)`, after backward. The truth for `grad_reduced` is then the gradient Adam
consumed, which it leaves in `.grad`: read whole (`full_tensor()`) after the step; the norm
before clipping is read in `on_before_optimizer_step`, which Lightning calls before it clips.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from conftest import reference_stats  # noqa: E402


class Model(pl.LightningModule):
    def __init__(self, out: str, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.consumed: list[dict] = []
        self.unclipped: list[float] = []
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.Tanh(), torch.nn.Linear(15, 3))
        self.out = out
        self.weights: list[dict] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for module in (self.net[0], self.net[2], self.net):
            fully_shard(module, mesh=mesh)

    def training_step(self, batch, _index):
        return self.net(batch[0]).pow(2).mean() * self.scale

    def _whole_grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.full_tensor().double() for n, p in self.named_parameters() if p.grad is not None}

    def on_before_optimizer_step(self, _optimizer) -> None:  # after backward, before clipping
        self.unclipped.append(float(sum((g * g).sum() for g in self._whole_grads().values()) ** 0.5))

    def on_train_batch_end(self, *_args) -> None:  # after the optimizer step
        self.weights.append({n: reference_stats(p.full_tensor()) for n, p in self.named_parameters()})
        grads = self._whole_grads()  # what Adam consumed: it leaves `.grad` as it read it
        self.consumed.append({"grad_reduced": {n: reference_stats(g) for n, g in grads.items()}})

    def on_train_end(self) -> None:
        with open(os.path.join(self.out, f"truth_rank{self.global_rank}.json"), "w") as fh:
            json.dump({"param_updated": self.weights, "consumed": self.consumed, "unclipped": self.unclipped}, fh)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--clip", action="store_true", help="gradient_clip_val=1.0, with gradients that need it")
    args = parser.parse_args()
    pl.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(0)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=3,
        gradient_clip_val=1.0 if args.clip else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(args.out, 50.0 if args.clip else 1.0), torch.utils.data.DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
