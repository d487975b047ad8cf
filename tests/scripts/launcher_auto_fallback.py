"""The one-line fallback for interpreters that skip sitecustomize (python -E/-I/-S): the
only msmon line in this otherwise ordinary script is the import below."""

import torch

import msmon.auto  # noqa: F401  (must come before the model and the optimizer are built)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(2):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print("trained", flush=True)
