"""The linear hook reads a module's stored weight, never a computed one: reading
`module.weight` can run code that changes training (a parametrization's forward, such as
spectral norm's power iteration updating its buffers, or a user's property drawing from the
global RNG), and a module's own `__getattr__` may raise anything."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.nn.utils import parametrizations

import l2_reference as direct
from conftest import rank_dir, read_csv_rows
from msmon import TrainerMon

CONFIG = {"recording_l2_features": True, "l2_targets": {"linear_hook": []}, "format": ["csv"], "ndigits": 12}


class SpectralNet(torch.nn.Module):
    """A spectral-normed layer: every read of `fc.weight` runs one power iteration in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = parametrizations.spectral_norm(torch.nn.Linear(6, 5))
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


class BayesianLinear(torch.nn.Module):
    """A Bayesian layer: its `weight` is a sample drawn from the global RNG at every read."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = torch.nn.Parameter(torch.randn(5, 6) * 0.3)
        self.log_sigma = torch.nn.Parameter(torch.full((5, 6), -3.0))

    @property
    def weight(self) -> torch.Tensor:
        return self.mu + self.log_sigma.exp() * torch.randn_like(self.mu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class BayesianNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = BayesianLinear()
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


class StrictLookup(torch.nn.Linear):
    """A module whose `__getattr__` raises a KeyError (not AttributeError) for unknown names,
    once built, as some registries of sub-layers do."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.built = True

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if self.__dict__.get("built"):
                raise KeyError(name) from None
            raise


class StrictNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = StrictLookup(6, 5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)))


def train(model_cls, config_path, steps: int = 4):
    """Losses and final state of `steps` steps; the weights every step's forward used."""
    torch.manual_seed(0)
    model = model_cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = None
    if config_path:
        mon = TrainerMon(config_path)
        mon.set_monitor(model, optimizer)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if mon is not None:
        mon.close()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("model_cls", [SpectralNet, BayesianNet, StrictNet])
def test_losses_and_state_are_bit_identical_when_reading_the_weight_would_run_code(model_cls, write_config, output_dir):
    plain_losses, plain_state = train(model_cls, None)
    losses, state = train(model_cls, write_config(CONFIG))
    assert losses == plain_losses
    assert plain_state.keys() == state.keys()
    assert all(torch.equal(plain_state[k], state[k]) for k in plain_state)


def test_a_parametrized_weight_is_recorded_from_its_stored_original(write_config, output_dir):
    torch.manual_seed(0)
    model = SpectralNet()
    original = model.fc.parametrizations.weight.original
    before = original.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config(CONFIG))
    mon.set_monitor(model, optimizer)
    F.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0])).backward()
    optimizer.step()
    mon.close()
    rows = {r["name"]: r for r in read_csv_rows(rank_dir(output_dir), "linear_hook")}
    assert set(rows) == {"fc.linear", "head.linear"}
    sigma, stable_rank = direct.spectral(before)
    assert float(rows["fc.linear"]["kernel_norm"]) == pytest.approx(sigma, rel=1e-4)
    assert float(rows["fc.linear"]["sr"]) == pytest.approx(stable_rank, rel=2e-4)


def test_a_computed_weight_property_is_not_a_stored_weight_and_is_never_read(write_config, output_dir):
    plain_losses, _ = train(BayesianNet, None, steps=2)
    losses, _ = train(BayesianNet, write_config(CONFIG), steps=2)
    assert losses == plain_losses
    assert {r["name"] for r in read_csv_rows(rank_dir(output_dir), "linear_hook")} == {"head.linear"}
