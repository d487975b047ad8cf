"""msprobe V2 configs (TrainerMonitorV2's `monitors`, `rank`, `stop_step`, ...) are read unchanged:
translated into msmon's keys with one line per V2 key, each monitor's ops kept as its own, V2's
window semantics kept (stop_step exclusive, collect_times 0 no limit), and every mistake one line
naming the key. The 2-rank comparison with msprobe itself is tests/e2e/test_msprobe_v2.py."""

from __future__ import annotations

import pytest

from conftest import MLP, rank_dir, read_csv_rows, train_steps
from msmon.config import ConfigError, parse_config
from msmon.config.resolved import resolved

V2 = {
    "framework": "pytorch",
    "output_dir": "./monitor_v2_out",
    "rank": [0, 1],
    "start_step": 1,
    "stop_step": 4,
    "step_interval": 1,
    "step_count_per_record": 1,
    "monitors": {
        "module": {"enabled": True, "targets": ["fc"], "ops": ["min", "max", "norm"]},
        "weight_grad": {"enabled": True, "ops": ["norm"]},
        "param": {"enabled": True, "ops": ["norm", "mean"]},
        "optimizer": {"enabled": True},
        "cc": {"enabled": True, "cc_codeline": [], "cc_pre_hook": False},
    },
}


def test_a_v2_config_becomes_the_msmon_keys_it_means_with_one_line_per_key():
    cfg = parse_config(V2)
    assert cfg.xy_distribution and cfg.wg_distribution and cfg.param_distribution and cfg.mv_distribution
    assert cfg.cc_distribution.enable and cfg.xy_name_contains == ["fc"] and cfg.targets == {}
    assert cfg.module_ranks == [0, 1] and cfg.start_step == 1 and cfg.format == ["csv"]
    assert cfg.collect_times == 3  # steps 1, 2, 3: start_step <= step < stop_step
    # each monitor keeps its own ops: the union is computed, each category writes its own
    assert cfg.ops == ["min", "max", "norm", "mean", "nans"]
    assert cfg.category_ops["actv"] == cfg.category_ops["actv_grad"] == ["min", "max", "norm"]
    assert cfg.category_ops["grad_reduced"] == cfg.category_ops["grad_unreduced"] == ["norm"]
    assert cfg.category_ops["param_origin"] == ["norm", "mean"]
    assert "exp_avg" not in cfg.category_ops and "other" not in cfg.category_ops  # V2's default ops: all of them
    keys = [line.split(" -> ")[0].removeprefix("msprobe V2 ") for line in cfg.translation]
    assert len(keys) == len(set(keys))  # one line per key
    assert set(keys) >= {"framework", "output_dir", "rank", "start_step", "stop_step", "monitors.module"}
    assert {"monitors.weight_grad", "monitors.param", "monitors.optimizer", "monitors.cc"} <= set(keys)
    assert all("\n" not in line for line in cfg.translation)
    assert any("xy_name_contains ['fc']" in line for line in cfg.translation)
    assert resolved(parse_config(resolved(cfg))) == resolved(cfg)  # config.json parses back to itself


@pytest.mark.parametrize(
    "window, collect_times",
    [
        ({"collect_times": 0}, 100_000_000),  # V2's 0: no limit, never "record nothing"
        ({"collect_times": 0, "stop_step": 10}, 10),
        ({"collect_times": 5}, 5),
        ({"collect_times": 2, "stop_step": 10}, 2),
        ({"start_step": 3, "stop_step": 10, "step_interval": 3}, 3),  # steps 3, 6, 9
        ({"start_step": 3, "stop_step": 3}, 0),  # start_step <= step < 3: no step
    ],
)
def test_the_v2_window_ends_where_v2_ends(window, collect_times):
    cfg = parse_config({"monitors": {"module": {}}, **window})
    assert cfg.collect_times == collect_times


def test_rank_is_an_int_or_a_list_and_an_empty_list_is_every_rank():
    assert parse_config({"monitors": {}, "rank": 3}).module_ranks == [3]
    assert parse_config({"monitors": {}, "rank": [0, 2]}).module_ranks == [0, 2]
    assert parse_config({"monitors": {}, "rank": []}).module_ranks == []


def test_only_module_is_on_by_default_as_in_v2():
    cfg = parse_config({"monitors": {"module": {}, "param": {}, "weight_grad": {"ops": ["norm"]}}})
    assert cfg.xy_distribution and not cfg.param_distribution and not cfg.wg_distribution
    assert cfg.ops == ["min", "max", "mean", "norm", "nans"] and cfg.category_ops == {}  # V2's default ops
    assert "msprobe V2 monitors.param -> off (V2 turns on only `module` by default)" in cfg.translation


def test_msmon_keys_in_a_v2_config_pass_through_unless_the_translation_sets_them():
    cfg = parse_config({"monitors": {}, "alert": {"rules": [{"rule_name": "AnomalyNan"}]}, "format": ["csv", "api"]})
    assert cfg.alert.rules[0].rule_name == "AnomalyNan" and cfg.format == ["csv", "api"]
    with pytest.raises(ConfigError, match="^ops: an msprobe V2 config sets it through `monitors`"):
        parse_config({"monitors": {}, "ops": ["norm"]})


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"framework": "mindspore"}, "framework: 'mindspore' is MindSpore; msmon monitors PyTorch jobs"),
        ({"framework": "jax"}, "framework: unknown framework 'jax'"),
        ({"monitors": {"modules": {}}}, "monitors.modules: unknown monitor 'modules' (did you mean 'module'?)"),
        ({"monitors": {"param": {"enabled": True, "param_dist": True}}}, "monitors.param: unknown key 'param_dist'"),
        ({"monitors": {"module": {"ops": ["norm", "median"]}}}, "monitors.module.ops: unknown op 'median'"),
        ({"monitors": {"module": {"targets": "fc"}}}, "monitors.module.targets: expected a list"),
        ({"monitors": {"module": {"enabled": "yes"}}}, "monitors.module.enabled: expected true or false"),
        ({"monitors": [], "rank": 0}, "monitors: expected an object"),
        ({"rank": "0"}, "rank: expected a rank number or a list of them"),
        ({"stop_step": 1, "start_step": 3}, "stop_step: expected an integer >= 3, got 1"),
        ({"collect_times": -1}, "collect_times: expected an integer >= 0, got -1"),
        ({"stop_stp": 4}, "unknown msprobe V2 config key 'stop_stp' (did you mean 'stop_step'"),
    ],
)
def test_a_v2_mistake_is_one_line_naming_the_key(cfg, message):
    with pytest.raises(ConfigError) as err:
        parse_config({"monitors": {}, **cfg} if "monitors" not in cfg else cfg)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_trainermon_reads_a_v2_file_records_each_monitors_own_ops_in_the_window(write_config, output_dir, caplog):
    """The API takes the V2 file as it is: rows only for start_step <= step < stop_step, each
    category with its monitor's ops as columns, the substring targets expanded against the model."""
    from msmon import TrainerMon

    path = write_config(V2 | {"rank": [], "monitors": {k: v for k, v in V2["monitors"].items() if k != "cc"}})
    torch_model = MLP()
    import torch

    optimizer = torch.optim.Adam(torch_model.parameters(), lr=1e-3)
    with caplog.at_level("INFO", logger="msmon"):
        monitor = TrainerMon(path, params_have_main_grad=False)
        monitor.set_monitor(torch_model, optimizer)
        train_steps(torch_model, optimizer, 6)
        monitor.close()
    assert "msmon: msprobe V2 stop_step -> collect_times 3: steps 1 <= step < 4" in caplog.messages
    assert "msmon: xy_name_contains ['fc'] selects the modules fc1, fc2" in caplog.messages
    directory = rank_dir(output_dir)
    expected_columns = {
        "actv": ["min", "max", "norm"],
        "actv_grad": ["min", "max", "norm"],
        "grad_reduced": ["norm"],
        "grad_unreduced": ["norm"],
        "param_origin": ["norm", "mean"],
        "exp_avg": ["min", "max", "norm", "mean", "nans"],
    }
    for category, columns in expected_columns.items():
        rows = read_csv_rows(directory, category)
        assert rows, category
        assert list(rows[0])[-len(columns) :] == columns, category
        assert {int(r["step"]) for r in rows} == {1, 2, 3}, category
    assert {r["name"] for r in read_csv_rows(directory, "actv")} == {
        "fc1.input",
        "fc1.output",
        "fc2.input",
        "fc2.output",
    }
