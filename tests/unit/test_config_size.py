"""Configs that are huge once read: a YAML alias bomb is refused with one line before anything
is built from it, and no config error formats a whole huge value."""

from __future__ import annotations

import json

import pytest
import torch

from msmon.config import ConfigError, load_config
from msmon.config.text import MAX_EXPANDED_VALUES


def alias_bomb(levels: int) -> str:
    """ "Billion laughs": each level lists the one before nine times, 9**levels strings in all."""
    lines = ["xy_distribution: true", "targets:", "  - &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"  - &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_in_one_line_that_says_so(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text(alias_bomb(7))  # 9**7 = 4.8 million strings from nine lines
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message == (
        f"config file {path} is not a monitor config: its YAML aliases expand it to more than "
        f"{MAX_EXPANDED_VALUES} values (an alias bomb?)"
    )


def test_yaml_aliases_that_expand_to_a_config_sized_document_are_read_as_before(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text(
        "xy_distribution: true\n"
        "targets:\n"
        '  fc1: &spec {input: "tuple[1]:0", output: "tensor"}\n'
        "  fc2: *spec\n"
        "ops: &ops [norm, max]\n"
    )
    config = load_config(path)
    assert set(config.targets) == {"fc1", "fc2"}
    assert config.targets["fc1"] == config.targets["fc2"]
    assert config.ops == ["norm", "max"]


@pytest.mark.parametrize(
    "config",
    [
        {"targets": [f"layers.{i}" for i in range(200_000)]},
        {"ops": "norm" * 100_000},
        {"targets": {"fc1": {"input": "x" * 1_000_000}}},
        {"format": [["csv"] * 1000] * 1000},
        {"k" * 1_000_000: True},
        {"append_output": ["d" * 1_000_000, None]},
    ],
    ids=["long-list", "long-string", "long-spec", "nested-lists", "long-key", "long-time-prefix"],
)
def test_a_config_error_shows_the_start_of_a_huge_value_not_all_of_it(tmp_path, config):
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message
    assert len(message) < 1500, message[:2000]
    assert "..." in message


def test_a_huge_target_naming_no_module_is_reported_by_its_start(write_config, output_dir):
    from conftest import MLP
    from msmon import TrainerMon

    model = MLP()
    mon = TrainerMon(write_config({"xy_distribution": True, "targets": {"fc" * 500_000: {}}}))
    with pytest.raises(ConfigError) as err:
        mon.set_monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    message = str(err.value)
    assert message.startswith("targets: 'fcfcfc") and "names no module or parameter of the model" in message
    assert len(message) < 1500
