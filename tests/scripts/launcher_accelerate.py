"""An ordinary `accelerate` training loop (gradient accumulation, no monitoring code).

`--api CONFIG` attaches the TrainerMon API after `accelerator.prepare`, for comparison with
what `msmon run` gives for the unmodified script.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=gen), torch.randn(48, 4, generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if args.api:
        from msmon import TrainerMon

        TrainerMon(args.api).set_monitor(model, optimizer)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    accelerator.print(f"done, last loss {loss.item():.6f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
