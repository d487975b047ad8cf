"""`import msmon.auto` in a script that forks two children with multiprocessing's fork start
method before it trains itself: a helper that builds nothing, and a child that trains (one
SGD step). The training child is monitored, the helper says nothing, and so does the parent,
which trains afterwards (in a function: its optimizer is dropped before exit) and is monitored
too."""

import multiprocessing

import torch

import msmon.auto  # noqa: F401


def train() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()


def helper() -> None:
    torch.zeros(2).sum()


if __name__ == "__main__":
    context = multiprocessing.get_context("fork")
    for target in (helper, train):
        child = context.Process(target=target)
        child.start()
        child.join()
        assert child.exitcode == 0
    train()
