"""An ordinary PyTorch Lightning script: `Trainer(strategy="ddp")`, automatic optimization
(forward and backward run inside `optimizer.step(closure)`), no monitoring code.

`--api CONFIG` attaches the TrainerMon API in `configure_optimizers`, for comparison with
what `msmon run` gives for the unmodified script.
"""

from __future__ import annotations

import argparse

import pytorch_lightning as pl
import torch


class Regressor(pl.LightningModule):
    def __init__(self, api_config: str | None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.api_config = api_config

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        if self.api_config:
            from msmon import TrainerMon

            TrainerMon(self.api_config).set_monitor(self, optimizer)
        return optimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=gen), torch.randn(48, 4, generator=gen))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(args.api), torch.utils.data.DataLoader(data, batch_size=4))


if __name__ == "__main__":
    main()
