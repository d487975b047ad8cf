"""A script that imports msmon's API before torch (and so msmon.api imports torch itself),
then trains without calling it: under `msmon run` it must be monitored all the same."""
# ruff: noqa: I001  (the import order is the point)

from msmon import TrainerMon  # noqa: F401  # imported first, on purpose

import torch  # noqa: E402

model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
