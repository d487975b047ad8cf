"""Training without any optimizer object: the weights are updated by hand."""

import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
for step in range(3):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    print(f"step {step} loss {loss.item():.6f}", flush=True)
