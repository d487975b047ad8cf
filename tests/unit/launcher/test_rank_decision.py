"""Which process is a training rank, decided where it is known: never a DataLoader worker, and
before torch.distributed starts, the rank its launcher gave it (RANK, else srun's SLURM_PROCID)."""

from __future__ import annotations

import torch

from msmon import TrainerMon, hooks
from msmon.config import load_config
from msmon.system.distributed import LOCAL_RANK_VARIABLES, current_rank, environment_rank


class _AskEveryItem(torch.utils.data.Dataset):
    """Reports, from wherever the item is loaded, whether a session built there may attach."""

    def __init__(self, config_path: str) -> None:
        self.config_path = config_path

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        session = hooks.Session(self.config_path, load_config(self.config_path), TrainerMon)
        return torch.tensor([hooks.in_dataloader_worker(), session.may_attach()])


def test_a_dataloader_worker_may_never_attach_even_with_its_own_session(write_config):
    dataset = _AskEveryItem(write_config({"wg_distribution": True}))
    assert dataset[0].tolist() == [False, True]  # the training process itself
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
    assert [item.tolist() for item in loader] == [[True, False], [True, False]]


def test_before_torch_distributed_starts_the_rank_comes_from_the_launcher_else_from_srun(monkeypatch):
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    assert current_rank() == 0
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert current_rank() == 5 and environment_rank(LOCAL_RANK_VARIABLES) == 1  # one of srun's tasks
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert current_rank() == 3 and environment_rank(LOCAL_RANK_VARIABLES) == 0  # a launcher inside the task
