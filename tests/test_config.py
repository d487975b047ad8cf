"""Every config mistake is a clear error before the first step; valid configs parse fully."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from msmon import TrainerMon
from msmon.config import ConfigError, TensorSpec, load_config, parse_config

from conftest import MLP


def test_defaults_match_msprobe_keys():
    cfg = parse_config({})
    assert cfg.format == ["tensorboard"]
    assert cfg.ops == ["norm", "min", "max", "mean"]
    assert cfg.eps == 1e-8 and cfg.ndigits == 6 and cfg.step_interval == 1
    assert cfg.collect_times == 100_000_000 and cfg.start_step == 0


def test_full_msprobe_config_parses():
    cfg = parse_config({
        "targets": {"layers.0": {"input": "tuple[2]:1", "output": "tensor"}, "": {}},
        "print_struct": False, "module_ranks": [0, 1], "ur_distribution": True, "xy_distribution": True,
        "all_xy": False, "forward_only": False, "backward_only": False, "mv_distribution": True,
        "param_distribution": True, "wg_distribution": True, "monitor_mbs_grad": True,
        "cc_distribution": {"enable": True, "cc_codeline": ["train.py\\[23\\]"], "cc_pre_hook": True,
                            "cc_log_only": False},
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True},
        "format": ["csv", "tensorboard"], "ops": ["norm", "nans", "infs"], "eps": 1e-6, "ndigits": 4,
        "step_count_per_record": 5, "start_step": 2, "step_interval": 3, "collect_times": 10,
        "squash_name": True,
    })
    assert cfg.targets["layers.0"]["input"] == TensorSpec("tuple[2]:1", 2, 1)
    assert cfg.targets["layers.0"]["output"].length is None
    assert cfg.alert.rules[0].threshold == 0.5 and cfg.alert.dump
    assert cfg.cc_distribution.cc_pre_hook and cfg.format == ["csv", "tensorboard"]


def test_format_accepts_a_single_string():
    assert parse_config({"format": "csv"}).format == ["csv"]


@pytest.mark.parametrize("cfg, fragment", [
    ({"wg_distributon": True}, "unknown config key 'wg_distributon' (did you mean 'wg_distribution'"),
    ({"wg_distribution": "yes"}, "wg_distribution: expected true or false, got 'yes'"),
    ({"ops": ["norm", "median"]}, "unknown op 'median'"),
    ({"ops": []}, "ops: expected at least one op"),
    ({"format": "parquet"}, "format: unknown format 'parquet'"),
    ({"targets": {"fc1": {"input": "tuple[2]:5"}}}, "index 5 is outside tuple[2]"),
    ({"targets": {"fc1": {"input": "list[2]"}}}, "expected \"tensor\", \"tuple[N]\" or \"tuple[N]:i\""),
    ({"targets": {"fc1": {"inputs": "tensor"}}}, "unknown key 'inputs'"),
    ({"targets": ["fc1"]}, "targets: expected an object"),
    ({"step_interval": 0}, "step_interval: expected an integer >= 1, got 0"),
    ({"ndigits": 2.5}, "ndigits: expected an integer, got 2.5"),
    ({"collect_times": True}, "collect_times: expected an integer"),
    ({"eps": -1}, "eps: expected a positive number"),
    ({"module_ranks": ["0"]}, "module_ranks: expected a list of rank numbers"),
    ({"alert": {"rules": [{"rule_name": "AnomalyTurbulance", "args": {"threshold": 1}}]}}, "did you mean 'AnomalyTurbulence'"),
    ({"alert": {"rules": [{"rule_name": "AnomalyTurbulence"}]}}, "AnomalyTurbulence needs a threshold"),
    ({"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": "big"}}]}}, "expected a positive number"),
    ({"cc_distribution": {"enable": 1}}, "cc_distribution.enable: expected true or false"),
    ({"cc_distribution": {"cc_codeline": ["("]}}, "is not a valid pattern"),
])
def test_bad_config_is_a_clear_error(cfg, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    assert fragment in str(err.value)


def test_msprobe_only_key_warns_instead_of_failing(caplog):
    caplog.set_level(logging.WARNING, logger="msmon")
    logging.getLogger("msmon").propagate = True
    parse_config({"mg_direction": True})
    assert any("mg_direction" in r.getMessage() for r in caplog.records)


def test_forward_only_and_backward_only_warns(caplog):
    caplog.set_level(logging.WARNING, logger="msmon")
    logging.getLogger("msmon").propagate = True
    parse_config({"forward_only": True, "backward_only": True})
    assert any("both true" in r.getMessage() for r in caplog.records)


def test_yaml_config_is_read(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text("wg_distribution: true\nops: [norm, nans]\nformat: csv\n")
    cfg = load_config(path)
    assert cfg.wg_distribution and cfg.ops == ["norm", "nans"]


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{\"wg_distribution\": true,,}")
    with pytest.raises(ConfigError, match="broken.json is not valid JSON"):
        load_config(path)


def test_target_naming_no_module_lists_closest_names(write_config, output_dir):
    path = write_config({"targets": {"fc3": {}}, "wg_distribution": True, "format": "csv"})
    model = MLP()
    mon = TrainerMon(path)
    with pytest.raises(ConfigError) as err:
        mon.set_monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "'fc3' names no module or parameter" in str(err.value)
    assert "fc1" in str(err.value) and "fc2" in str(err.value)
    mon.close()


def test_unwritable_output_directory_fails_at_start(write_config, tmp_path, monkeypatch):
    blocker = tmp_path / "file_not_dir"
    blocker.write_text("x")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(blocker / "sub"))
    with pytest.raises(ConfigError, match="not writable"):
        TrainerMon(write_config({"wg_distribution": True}))


def test_params_have_main_grad_true_without_main_grad_is_a_clear_error(write_config, output_dir):
    model = MLP()
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv"}), params_have_main_grad=True)
    with pytest.raises(ConfigError, match="no `main_grad`"):
        mon.set_monitor(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mon.close()


def test_ops_setter_validates(write_config, output_dir):
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv"}))
    mon.ops = ["norm", "infs"]
    assert mon.ops == ["norm", "infs"]
    with pytest.raises(ConfigError):
        mon.ops = ["nrm"]
    mon.close()
