"""Every config mistake is a clear error before the first step; valid configs parse fully."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import MLP
from msmon import TrainerMon
from msmon.config import ConfigError, TensorSpec, load_config, parse_config


def test_defaults_match_msprobe_keys():
    cfg = parse_config({})
    assert cfg.format == ["tensorboard"]
    assert cfg.ops == ["norm", "min", "max", "mean"]
    assert cfg.eps == 1e-8 and cfg.ndigits == 6 and cfg.step_interval == 1
    assert cfg.collect_times == 100_000_000 and cfg.start_step == 0


def test_full_msprobe_config_parses():
    cfg = parse_config(
        {
            "targets": {"layers.0": {"input": "tuple[2]:1", "output": "tensor"}, "": {}},
            "print_struct": False,
            "module_ranks": [0, 1],
            "ur_distribution": True,
            "xy_distribution": True,
            "all_xy": False,
            "forward_only": False,
            "backward_only": False,
            "mv_distribution": True,
            "param_distribution": True,
            "wg_distribution": True,
            "monitor_mbs_grad": True,
            "cc_distribution": {
                "enable": True,
                "cc_codeline": ["train.py\\[23\\]"],
                "cc_pre_hook": True,
                "cc_log_only": False,
            },
            "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True},
            "format": ["csv", "tensorboard"],
            "ops": ["norm", "nans", "infs"],
            "eps": 1e-6,
            "ndigits": 4,
            "step_count_per_record": 5,
            "start_step": 2,
            "step_interval": 3,
            "collect_times": 10,
            "squash_name": True,
        }
    )
    assert cfg.targets["layers.0"]["input"] == TensorSpec("tuple[2]:1", 2, 1)
    assert cfg.targets["layers.0"]["output"].length is None
    assert cfg.alert.rules[0].threshold == 0.5 and cfg.alert.dump
    assert cfg.cc_distribution.cc_pre_hook and cfg.format == ["csv", "tensorboard"]


def test_format_accepts_a_single_string():
    assert parse_config({"format": "csv"}).format == ["csv"]


@pytest.mark.parametrize(
    "cfg, fragment",
    [
        ({"wg_distributon": True}, "unknown config key 'wg_distributon' (did you mean 'wg_distribution'"),
        ({"wg_distribution": "yes"}, "wg_distribution: expected true or false, got 'yes'"),
        ({"ops": ["norm", "median"]}, "unknown op 'median'"),
        ({"ops": []}, "ops: expected at least one op"),
        ({"format": 3}, "format: expected an output format's name or a list of them, got 3"),
        ({"format": ["csv", None]}, "format: expected an output format's name or a list of them, got ['csv', None]"),
        ({"targets": {"fc1": {"input": "tuple[2]:5"}}}, "index 5 is outside tuple[2]"),
        ({"targets": {"fc1": {"input": "list[2]"}}}, 'expected "tensor", "tuple[N]" or "tuple[N]:i"'),
        ({"targets": {"fc1": {"inputs": "tensor"}}}, "unknown key 'inputs'"),
        ({"targets": ["fc1"]}, "targets: expected an object"),
        ({"step_interval": 0}, "step_interval: expected an integer >= 1, got 0"),
        ({"ndigits": 2.5}, "ndigits: expected an integer, got 2.5"),
        ({"collect_times": True}, "collect_times: expected an integer"),
        ({"eps": -1}, "eps: expected a positive number"),
        ({"module_ranks": ["0"]}, "module_ranks: expected a list of rank numbers"),
        (
            {"alert": {"rules": [{"rule_name": "AnomalyTurbulance", "args": {"threshold": 1}}]}},
            "did you mean 'AnomalyTurbulence'",
        ),
        ({"alert": {"rules": [{"rule_name": "AnomalyTurbulence"}]}}, "AnomalyTurbulence needs a threshold"),
        (
            {"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": "big"}}]}},
            "expected a positive number",
        ),
        ({"cc_distribution": {"enable": 1}}, "cc_distribution.enable: expected true or false"),
        ({"cc_distribution": {"cc_codeline": ["("]}}, "is not a valid pattern"),
    ],
)
def test_bad_config_is_a_clear_error(cfg, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    assert fragment in str(err.value)


def test_msprobe_only_key_warns_instead_of_failing(caplog, monkeypatch):
    """Every msprobe key is implemented now; the mechanism stays for keys msprobe adds later."""
    import msmon.config as config_module

    monkeypatch.setitem(config_module.MSPROBE_ONLY_KEYS, "future_key", "a later msprobe feature")
    caplog.set_level(logging.WARNING, logger="msmon")
    logging.getLogger("msmon").propagate = True
    parse_config({"future_key": True})
    assert any("future_key" in r.getMessage() for r in caplog.records)


def test_no_msprobe_key_is_left_unimplemented():
    from msmon.config import MSPROBE_ONLY_KEYS

    assert MSPROBE_ONLY_KEYS == {}


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
    path.write_text('{"wg_distribution": true,,}')
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


# -- numbers: non-finite values are errors, integral floats are integers -------------------------
@pytest.mark.parametrize(
    "text, fragment",
    [
        ('{"eps": NaN, "ops": ["zeros"]}', "eps: expected a positive number, got nan (not a finite number)"),
        ('{"eps": Infinity}', "eps: expected a positive number, got inf (not a finite number)"),
        (
            '{"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": NaN}}]}}',
            "alert.rules[0].args.threshold: expected a positive number, got nan (not a finite number)",
        ),
        (
            '{"alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": Infinity}}]}}',
            "alert.rules[0].args.threshold: expected a positive number, got inf",
        ),
        ('{"collect_times": NaN}', "collect_times: expected an integer, got nan (not a finite number)"),
        ('{"alert": {"max_lines_per_step": -Infinity}}', "alert.max_lines_per_step: expected an integer, got -inf"),
        ('{"module_ranks": [0, NaN]}', "module_ranks[1]: expected an integer, got nan"),
    ],
)
def test_non_finite_numbers_in_a_json_config_are_errors_naming_the_key(tmp_path, text, fragment):
    path = tmp_path / "monitor.json"
    path.write_text(text)  # Python's json reads the NaN / Infinity literals
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert fragment in str(err.value)


def test_yaml_nan_threshold_and_eps_are_errors_naming_the_key(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text("alert:\n  rules:\n    - rule_name: AnomalyTurbulence\n      args: {threshold: .nan}\n")
    with pytest.raises(ConfigError, match=r"alert.rules\[0\].args.threshold: expected a positive number, got nan"):
        load_config(path)
    path.write_text("eps: .inf\n")
    with pytest.raises(ConfigError, match="eps: expected a positive number, got inf"):
        load_config(path)


def test_a_nan_threshold_is_a_config_error_of_trainermon(tmp_path, output_dir):
    path = tmp_path / "monitor.json"
    path.write_text(
        '{"wg_distribution": true, "alert": {"rules": [{"rule_name": "AnomalyTurbulence", '
        '"args": {"threshold": NaN}}]}}'
    )
    with pytest.raises(ConfigError, match="threshold"):
        TrainerMon(str(path))


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "monitor.json",
            '{"collect_times": 1e8, "start_step": 2.0, "step_interval": 3e0, "ndigits": 4.0, '
            '"step_count_per_record": 1E1, "grad_acc_steps": 2.0, "module_ranks": [0, 1.0], '
            '"alert": {"max_lines_per_step": 5.0}}',
        ),
        (
            "monitor.yaml",
            "collect_times: 1e8\nstart_step: 2.0\nstep_interval: 3e0\nndigits: 4.0\n"
            "step_count_per_record: 1E1\ngrad_acc_steps: 2.0\nmodule_ranks: [0, 1.0]\n"
            "alert: {max_lines_per_step: 5.0}\n",
        ),
    ],
)
def test_integral_floats_like_1e8_are_accepted_where_an_integer_is_meant(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    cfg = load_config(path)
    values = (
        cfg.collect_times,
        cfg.start_step,
        cfg.step_interval,
        cfg.ndigits,
        cfg.step_count_per_record,
        cfg.grad_acc_steps,
        *cfg.module_ranks,
        cfg.alert.max_lines_per_step,
    )
    assert values == (100_000_000, 2, 3, 4, 10, 2, 0, 1, 5)
    assert all(type(v) is int for v in values)


@pytest.mark.parametrize(
    "cfg, fragment",
    [
        ({"collect_times": 1.5e0}, "collect_times: expected an integer, got 1.5"),
        ({"grad_acc_steps": 2.5}, "grad_acc_steps: expected an integer, got 2.5"),
        ({"module_ranks": [0.5]}, "module_ranks[0]: expected an integer, got 0.5"),
        ({"step_interval": 0.0}, "step_interval: expected an integer >= 1, got 0"),
    ],
)
def test_non_integral_floats_stay_errors_where_an_integer_is_meant(cfg, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    assert fragment in str(err.value)


# -- the file's text: UTF-8, ASCII punctuation ---------------------------------------------------
@pytest.mark.parametrize(
    "name, text, where, char",
    [
        (
            "monitor.json",
            '{"wg_distribution": true\uff0c "ops": ["norm"]}',
            "line 1, column 25",
            "'\uff0c' U+FF0C FULLWIDTH COMMA is not ASCII; write ',' instead",
        ),
        (
            "monitor.json",
            '{\n  "wg_distribution"\uff1a true\n}',
            "line 2, column 20",
            "'\uff1a' U+FF1A FULLWIDTH COLON is not ASCII; write ':' instead",
        ),
        (
            "monitor.json",
            '{\n "ops": [\u201cnorm\u201d]}',
            "line 2, column 10",
            "'\u201c' U+201C LEFT DOUBLE QUOTATION MARK is not ASCII; write '\"' instead",
        ),
        (
            "monitor.yaml",
            "# \u76d1\u63a7\u914d\u7f6e\uff0c\u5f00\u542f\u68af\u5ea6\nwg_distribution: true  # \u6ce8\u91ca\uff0c\n"
            "ops: [norm\uff0cmax]\n",
            "line 3, column 11",
            "'\uff0c' U+FF0C FULLWIDTH COMMA",
        ),
    ],
)
def test_full_width_punctuation_is_an_error_naming_file_line_column_and_character(
    tmp_path, output_dir, name, text, where, char
):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        TrainerMon(str(path))
    message = str(err.value)
    assert message.startswith(f"config file {path}: {where}: ") and char in message
    assert "\n" not in message


def test_full_width_punctuation_in_yaml_comments_is_fine(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text(
        "# \u76d1\u63a7\u914d\u7f6e\uff0c\u5f00\u542f\u68af\u5ea6\uff1a\nwg_distribution: true  # \u6ce8\u91ca\uff0c\u597d\n"  # noqa: E501
        "targets: {'a #b': {}}  # \u201cok\u201d\n",
        encoding="utf-8",
    )
    cfg = load_config(path)
    assert cfg.wg_distribution and list(cfg.targets) == ["a #b"]


@pytest.mark.parametrize(
    "data, where, byte",
    [
        (
            '{"wg_distribution": true,\n "ops": ["norm"\uff0c "max"]}'.encode("gbk"),
            "line 2, column 16",
            "byte 0xA3 (in GBK, '\uff0c' U+FF0C FULLWIDTH COMMA)",
        ),
        (
            '{"targets": {"caf\u00e9": {}}}'.encode("latin-1"),
            "line 1, column 18",
            "byte 0xE9 (in Latin-1, '\u00e9' U+00E9 LATIN SMALL LETTER E WITH ACUTE)",
        ),
    ],
)
def test_a_config_that_is_not_utf8_is_an_error_naming_file_line_column_and_byte(
    tmp_path, output_dir, data, where, byte
):
    path = tmp_path / "monitor.json"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        TrainerMon(str(path))
    assert str(err.value) == f"config file {path} is not UTF-8: {where}: {byte}; save the file as UTF-8"


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "monitor.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"wg_distribution": True}).encode())
    assert load_config(path).wg_distribution


def test_yaml_syntax_errors_are_one_line_with_line_and_column(tmp_path):
    path = tmp_path / "monitor.yaml"
    path.write_text("ops: [norm, max\nwg_distribution: true\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"config file {path} is not valid YAML: line 2, column 16: ")
    assert "\n" not in str(err.value)


def test_every_config_key_is_declared_once_in_the_schema_with_a_type_a_default_and_a_doc_line():
    """The validator reads its key lists from the schema's fields: a bool field takes only true
    or false, an int field only integers from its declared minimum, and the defaults of a
    parsed empty config are the fields' defaults."""
    import dataclasses

    from msmon.config import schema

    fields = {f.name: f for f in dataclasses.fields(schema.MonitorConfig)}
    assert set(schema.VALID_KEYS) == set(fields) - {"raw", "translation"} == set(schema.DOCS)
    assert all(doc.strip() and "\n" not in doc for doc in schema.DOCS.values())
    assert schema.BOOL_KEYS and schema.INT_KEYS
    for key in schema.BOOL_KEYS:
        assert fields[key].default is False
        with pytest.raises(ConfigError, match=f"{key}: expected true or false"):
            parse_config({key: 1})
        assert getattr(parse_config({key: True}), key) is True
    for key, minimum in schema.INT_KEYS.items():
        with pytest.raises(ConfigError, match=f"{key}: expected an integer >= {minimum}"):
            parse_config({key: minimum - 1})
        assert getattr(parse_config({key: minimum}), key) == minimum
    empty = dataclasses.asdict(parse_config({}))
    assert {k: v for k, v in empty.items() if k != "raw"} == {
        k: v for k, v in dataclasses.asdict(schema.MonitorConfig()).items() if k != "raw"
    }


def test_tensorboard_layout_defaults_to_msprobes_and_refuses_another_value():
    assert parse_config({}).tensorboard_layout == "msprobe"
    assert parse_config({"tensorboard_layout": "by_rank"}).tensorboard_layout == "by_rank"
    for bad in ("per_rank", 1, None):
        with pytest.raises(ConfigError, match=r"tensorboard_layout: expected one of \['msprobe', 'by_rank'\]"):
            parse_config({"tensorboard_layout": bad})


def test_the_resolved_config_holds_every_key_and_parses_back_to_itself():
    from msmon.config import VALID_KEYS
    from msmon.config.resolved import resolved

    given = {
        "targets": {"fc1": {"input": "tuple[2]:0"}},
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True},
        "cc_distribution": {"enable": True},
        "append_output": ["Dec03_21-34-40", None],
    }
    written = resolved(parse_config(given))
    assert list(written) == list(VALID_KEYS)
    assert written["targets"] == given["targets"] and written["alert"]["rules"] == given["alert"]["rules"]
    assert written["cc_distribution"] == {"enable": True, "cc_codeline": [], "cc_pre_hook": False, "cc_log_only": False}
    assert written["nan_origin"] is True  # None in the file: on, since an alert rule is set
    assert written["ops"] == ["norm", "min", "max", "mean"] and written["format"] == ["tensorboard"]
    assert resolved(parse_config(written)) == written
