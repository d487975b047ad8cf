"""Two gloo ranks that never make an optimizer step.

--optimizer none: inference only, no optimizer at all; unstepped: an Adam built and never
stepped; loose: an SGD over a bare tensor of no module, never stepped.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=["none", "unstepped", "loose"], default="none")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).eval()
    if args.optimizer == "unstepped":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    elif args.optimizer == "loose":
        optimizer = torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1)  # noqa: F841
    with torch.no_grad():
        total = model(torch.randn(4, 8)).sum()
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} output {total.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
