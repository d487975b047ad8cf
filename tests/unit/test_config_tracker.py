"""The `tracker` key (the wandb and mlflow formats): its defaults, and every mistake one line naming the key."""

from __future__ import annotations

import pytest

from msmon.config import ConfigError, parse_config
from msmon.config.resolved import resolved


def test_the_tracker_key_has_defaults_and_takes_its_sub_keys():
    assert parse_config({}).tracker.max_keys == 1000 and parse_config({}).tracker.tensors == []
    cfg = parse_config({"tracker": {"project": "llm", "run_name": "r1", "max_keys": 1e3, "tensors": "actv/*"}})
    assert (cfg.tracker.project, cfg.tracker.run_name, cfg.tracker.max_keys) == ("llm", "r1", 1000)
    assert cfg.tracker.tensors == ["actv/*"]
    assert parse_config(resolved(cfg)).tracker == cfg.tracker  # config.json parses back


@pytest.mark.parametrize(
    "tracker, message",
    [
        ({"max_key": 10}, "tracker: unknown key 'max_key' (did you mean 'max_keys'?)"),
        ({"max_keys": 0}, "tracker.max_keys: expected an integer >= 1, got 0"),
        ({"project": ""}, "tracker.project: expected a name (a non-empty string) or null, got ''"),
        ({"tensors": [3]}, 'tracker.tensors: expected a list of "category/name" patterns'),
        ([], "tracker: expected an object"),
    ],
)
def test_a_tracker_mistake_is_one_line_naming_the_key(tracker, message):
    with pytest.raises(ConfigError) as err:
        parse_config({"tracker": tracker})
    assert str(err.value).startswith(message)
