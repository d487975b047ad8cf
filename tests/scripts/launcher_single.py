"""An ordinary single-process training script, with no monitoring code: a small MLP on
random data. `--crash-at N` raises at step N (a crash in the user's code); `--exit-code N`
ends the script with `sys.exit(N)`."""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--exit-code", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        if step == args.crash_at:
            raise ValueError(f"crash at step {step}")
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
