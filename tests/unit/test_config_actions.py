"""`alert.actions`: what each action takes, its escalated config, and every mistake one line
naming the entry and the key (with the closest name where one was mistyped)."""

from __future__ import annotations

import json

import pytest

from msmon.anomaly.fault_kind import KINDS
from msmon.config import ConfigError, parse_config
from msmon.config.actions import escalated
from msmon.config.resolved import resolved
from msmon.config.schema import VERDICT_CODES

RULES = [{"rule_name": "AnomalyNan"}, {"rule_name": "AnomalyTurbulence", "args": {"threshold": 2}}]


def config(*actions: dict, **keys) -> dict:
    return {"wg_distribution": True, "alert": {"rules": RULES, "actions": list(actions)}, **keys}


def test_the_config_knows_every_verdict_code_the_fault_kind_tells():
    assert set(VERDICT_CODES) == set(KINDS)


def test_each_action_takes_its_keys_and_the_config_json_parses_back():
    cfg = parse_config(
        config(
            {"on": ["AnomalyTurbulence", "verdict:one_rank_data"], "do": "escalate", "for_steps": 3,
             "config": {"all_xy": True, "replica_check": {"every": 1}}},
            {"on": "AnomalyNan", "do": "skip_step", "max_per_run": 4},
            {"on": ["verdict:one_rank_model_copy"], "do": "stop", "repeat_limit": 3},
            {"on": ["AnomalyNan"], "do": "notify", "url": "http://127.0.0.1:9/hook", "timeout": 1, "retries": 0},
            {"on": ["AnomalyNan"], "do": "notify", "command": ["notify.sh", "--to", "ops"]},
        )
    )  # fmt: skip
    escalate, skip, stop, post, command = cfg.alert.actions
    assert (escalate.rules, escalate.verdicts, escalate.for_steps) == (["AnomalyTurbulence"], ["one_rank_data"], 3)
    assert (skip.on, skip.max_per_run, stop.repeat_limit) == (["AnomalyNan"], 4, 3)
    assert (post.url, post.timeout, post.retries, command.command) == (
        "http://127.0.0.1:9/hook", 1.0, 0, ["notify.sh", "--to", "ops"],
    )  # fmt: skip
    again = parse_config(json.loads(json.dumps(resolved(cfg))))  # config.json is JSON and parses back
    assert again.alert.actions == cfg.alert.actions and again.alert.vote_timeout == 600.0


def test_an_escalated_config_is_the_base_plus_its_keys_merged_key_by_key_with_the_base_alert_section():
    cfg = parse_config(
        config(
            {
                "on": ["AnomalyNan"],
                "do": "escalate",
                "for_steps": 2,
                "config": {"all_xy": True, "replica_check": {"every": 1}},
            },
            replica_check={"enable": True, "every": 50, "grads": True},
            ops=["norm", "max"],
        )
    )
    up = escalated(cfg, cfg.alert.actions[0].config, parse_config)
    assert up.all_xy and up.wg_distribution and up.ops == ["norm", "max"]
    assert (up.replica_check.enable, up.replica_check.every, up.replica_check.grads) == (True, 1, True)
    assert up.alert is cfg.alert
    assert not cfg.all_xy and cfg.replica_check.every == 50  # the base is untouched


@pytest.mark.parametrize(
    "action, message",
    [
        ({"on": ["AnomalyNan"], "do": "escalte"},
         "alert.actions[0].do: unknown action 'escalte'; expected one of ['escalate', 'skip_step', 'stop', 'notify'] "
         "(did you mean 'escalate'?)"),
        ({"on": ["AnomalyNan"]}, "alert.actions[0]: no 'do'"),
        ({"on": ["AnomalyNam"], "do": "stop"},
         "alert.actions[0].on: unknown rule 'AnomalyNam' (did you mean 'AnomalyNan'"),
        ({"on": ["verdict:one_rank_copy"], "do": "stop"},
         "alert.actions[0].on: unknown verdict 'one_rank_copy'; expected one of ['verdict:one_rank_data'"),
        ({"on": [], "do": "stop"}, "alert.actions[0].on: expected a list of rule names and verdicts"),
        ({"on": ["AnomalyNan"], "do": "stop", "url": "http://x"},
         "alert.actions[0]: unknown key 'url' for 'stop' (a key of 'notify')"),
        ({"on": ["AnomalyNan"], "do": "stop", "repeat_limt": 2},
         "alert.actions[0]: unknown key 'repeat_limt' for 'stop' (did you mean 'repeat_limit'?)"),
        ({"on": ["AnomalyRankOutlier"], "do": "stop"},
         "alert.actions[0].on: 'AnomalyRankOutlier' is not in alert.rules, so it never alerts; add it there"),
        ({"on": ["ReplicaMismatch"], "do": "stop"},
         "alert.actions[0].on: 'ReplicaMismatch' needs replica_check.enable"),
        ({"on": ["NanOrigin"], "do": "skip_step"},
         "alert.actions[0].on: skip_step is decided before the optimizer step, from the step's own rows; 'NanOrigin' "
         "is known only after it"),
        ({"on": ["AnomalyNan"], "do": "escalate", "config": {"all_xy": True}},
         "alert.actions[0]: escalate needs 'for_steps'"),
        ({"on": ["AnomalyNan"], "do": "escalate", "for_steps": 0, "config": {"all_xy": True}},
         "alert.actions[0].for_steps: expected an integer >= 1, got 0"),
        ({"on": ["AnomalyNan"], "do": "escalate", "for_steps": 3, "config": {}},
         "alert.actions[0].config: expected the keys"),
        ({"on": ["AnomalyNan"], "do": "escalate", "for_steps": 3, "config": {"format": ["csv"]}},
         "alert.actions[0].config: 'format' cannot change during a run"),
        ({"on": ["AnomalyNan"], "do": "escalate", "for_steps": 3, "config": {"all_xyy": True}},
         "alert.actions[0].config: unknown config key 'all_xyy' (did you mean 'all_xy'?)"),
        ({"on": ["AnomalyNan"], "do": "escalate", "for_steps": 3, "config": {"ops": ["nrom"]}},
         "alert.actions[0].config: ops: unknown op 'nrom'"),
        ({"on": ["AnomalyNan"], "do": "notify"},
         "alert.actions[0]: notify needs exactly one of 'url' (POST a JSON message) or 'command' (run it)"),
        ({"on": ["AnomalyNan"], "do": "notify", "url": "ftp://host/x"},
         "alert.actions[0].url: expected an http:// or https:// address"),
        ({"on": ["AnomalyNan"], "do": "notify", "command": "notify.sh", "timeout": 0},
         "alert.actions[0].timeout: expected a positive number of seconds, got 0"),
        ({"on": ["AnomalyNan"], "do": "skip_step", "max_per_run": 0},
         "alert.actions[0].max_per_run: expected an integer >= 1"),
    ],
)  # fmt: skip
def test_an_action_mistake_is_one_line_naming_the_entry_and_the_key(action, message):
    rules = [RULES[0]] if action.get("on") == ["AnomalyRankOutlier"] else RULES
    with pytest.raises(ConfigError) as err:
        parse_config({"alert": {"rules": rules, "actions": [action]}})
    text = str(err.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_the_vote_timeout_is_a_positive_number_of_seconds():
    assert parse_config({"alert": {"vote_timeout": 30}}).alert.vote_timeout == 30.0
    with pytest.raises(ConfigError, match=r"^alert.vote_timeout: expected a positive number"):
        parse_config({"alert": {"vote_timeout": -1}})
