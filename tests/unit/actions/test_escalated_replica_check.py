"""An escalation may change replica_check (every rank switches at the same step), where an edit of
the config file may not (ranks read it at different steps): the replica check's state follows the
escalated config only when it is applied in lockstep."""

from __future__ import annotations

import logging

from msmon.collectors.replica_check.state import replica_state
from msmon.config import parse_config
from msmon.config.actions import escalated
from msmon.runtime.step_context import StepContext

CONFIG = {
    "wg_distribution": True,
    "replica_check": {"enable": True, "every": 50},
    "alert": {
        "rules": [{"rule_name": "AnomalyNan"}],
        "actions": [
            {"on": ["AnomalyNan"], "do": "escalate", "for_steps": 2, "config": {"replica_check": {"every": 1}}}
        ],
    },
}


def test_the_replica_check_follows_an_escalation_and_its_end_but_not_a_file_edit(tmp_path, caplog):
    base = parse_config(CONFIG)
    ctx = StepContext(0, base, str(tmp_path))
    assert replica_state(ctx).settings.every == 50
    ctx.config = escalated(base, base.alert.actions[0].config, parse_config)
    ctx.lockstep_edit = True
    assert replica_state(ctx).settings.every == 1 and replica_state(ctx).settings.enable
    ctx.config = base
    assert replica_state(ctx).settings.every == 50  # the escalation's end, in lockstep too
    ctx.lockstep_edit = False
    ctx.config = parse_config({**CONFIG, "replica_check": {"enable": True, "every": 5}})
    with caplog.at_level(logging.WARNING, logger="msmon"):
        assert replica_state(ctx).settings.every == 50  # a file edit: the next run's
    assert "replica_check was edited during the run" in caplog.text
