"""Models that import nothing of msmon, so a process without msmon can unpickle them."""

from __future__ import annotations

import torch


class LstmNet(torch.nn.Module):
    """An LSTM (whose class defines its own __getstate__) between two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 6)
        self.rnn = torch.nn.LSTM(6, 6, batch_first=True)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.rnn(torch.tanh(self.embed(x)))[0])
