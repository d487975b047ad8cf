"""`msmon analyse` (run_analyse): cross-rank ordering, the verdict, both dump layouts, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from msmon.offline.analyse.command import REPORT_FILE, run_analyse
from msmon.offline.analyse.msprobe_format import MSPROBE_ANALYSE_FILE
from msmon.offline.analyse.reading import event_from_msprobe


def rec(rank, step, micro, stage, pp, call, name, category, vpp=0, rule="AnomalyNan", op="nans", value=1.0, **extra):
    return dict(
        rank=rank,
        step=step,
        micro_step=micro,
        pp_stage=pp,
        vpp_stage=vpp,
        stage=stage,
        call_id=call,
        name=name,
        category=category,
        op=op,
        value=value,
        history=None,
        rule=rule,
        message="",
        group_mates=[0, 1],
        **extra,
    )


def write_dump(directory, rank, records, name="anomaly.jsonl"):
    path = directory / f"rank{rank}" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return path


def analysed(directory, output=None):
    path = directory / REPORT_FILE if output is None else output
    return json.loads(path.read_text())


def order_of(result):
    return [(e["rank"], e["step"], e["micro_step"], e["stage"], e["name"]) for e in result["top_k"]]


def test_two_stage_pipeline_events_are_ordered_in_training_time(tmp_path, capsys):
    # rank 0 is pipeline stage 0, rank 1 stage 1; events written in a scrambled order
    write_dump(
        tmp_path,
        0,
        [
            rec(0, 7, None, "optimizer", 0, 90, "fc1.weight", "grad_reduced"),
            rec(0, 7, 0, "backward", 0, 30, "fc1.output", "actv_grad"),
            rec(0, 7, 1, "forward", 0, 40, "fc1.output", "actv"),
            rec(0, 7, 0, "forward", 0, 5, "fc1.output", "actv"),
            rec(0, 7, None, "backward", 0, 60, "fc1.weight", "grad_unreduced"),
            rec(0, 6, 1, "optimizer", 0, 99, "late.weight", "param_origin"),
        ],
    )
    write_dump(
        tmp_path,
        1,
        [
            rec(1, 7, 0, "backward", 1, 20, "fc3.output", "actv_grad"),
            rec(1, 7, 0, "forward", 1, 3, "fc3.output", "actv"),
            rec(1, 7, 0, "forward", 1, 2, "fc3.input", "actv"),
        ],
    )
    assert run_analyse(str(tmp_path), top_k=20) == 0
    assert order_of(analysed(tmp_path)) == [
        (0, 6, 1, "optimizer", "late.weight"),  # an earlier step first, whatever its stage
        (0, 7, 0, "forward", "fc1.output"),  # forward: stage 0 before stage 1
        (1, 7, 0, "forward", "fc3.input"),  # then by call order within the rank
        (1, 7, 0, "forward", "fc3.output"),
        (1, 7, 0, "backward", "fc3.output"),  # backward: the last stage first
        (0, 7, 0, "backward", "fc1.output"),
        (0, 7, 1, "forward", "fc1.output"),  # micro-step 1 after all of micro-step 0
        (0, 7, None, "backward", "fc1.weight"),  # whole-step statistics after every micro-step
        (0, 7, None, "optimizer", "fc1.weight"),
    ]
    out = capsys.readouterr().out
    assert "First anomaly: rank 0, step 6, micro-step 1, weight late.weight before the update (nans" in out


def test_virtual_pipeline_chunks_order_before_pipeline_stages_and_reverse_in_backward(tmp_path):
    events = [
        rec(r, 1, 0, stage, pp, 0, f"{stage}.v{vpp}.p{pp}", "actv" if stage == "forward" else "actv_grad", vpp=vpp)
        for r, pp in ((0, 0), (1, 1))
        for vpp in (0, 1)
        for stage in ("forward", "backward")
    ]
    for rank in (0, 1):
        write_dump(tmp_path, rank, [e for e in events if e["rank"] == rank])
    assert run_analyse(str(tmp_path), top_k=8) == 0
    assert [e["name"] for e in analysed(tmp_path)["top_k"]] == [
        "forward.v0.p0",
        "forward.v0.p1",
        "forward.v1.p0",
        "forward.v1.p1",
        "backward.v1.p1",
        "backward.v1.p0",
        "backward.v0.p1",
        "backward.v0.p0",
    ]


def test_the_verdict_names_the_first_anomaly_the_spread_and_the_first_non_finite_origin(tmp_path, capsys):
    write_dump(
        tmp_path,
        3,
        [
            rec(3, 41210, 2, "forward", 0, 11, "layers.17.mlp.fc2.output", "actv", op="nans", value=12.0),
            rec(3, 41210, 2, "forward", 0, 12, "layers.18.input", "actv"),
        ],
    )
    write_dump(
        tmp_path,
        5,
        [
            rec(5, 41210, None, "optimizer", 0, 3, "layers.0.fc1.weight", "grad_reduced", op="norm", value="nan"),
            rec(
                5,
                41210,
                0,
                "backward",
                0,
                40,
                "layers.2.attn.input",
                "actv_grad",
                rule="NanOrigin",
                op="nonfinite",
                value="nan",
            ),
        ],
    )
    (tmp_path / "result").mkdir()
    assert run_analyse(str(tmp_path), output=str(tmp_path / "result")) == 0
    out = capsys.readouterr().out
    assert (
        "First anomaly: rank 5, step 41210, micro-step 0, backward input gradient of layers.2.attn "
        "(first non-finite; NanOrigin)."
    ) in out
    result = analysed(tmp_path, tmp_path / "result" / REPORT_FILE)
    assert result["nan_origin"]["name"] == "layers.2.attn.input"
    assert (
        result["first_per_rank"]["3"]["description"]
        == "rank 3, step 41210, micro-step 2, forward: forward output of layers.17.mlp.fc2 (nans)"
    )
    assert "Other ranks' first anomalies came later: rank 3 at step 41210 forward" in out
    assert "4 anomalies in all, on 2 ranks, in step 41210." in out


def test_a_nan_origin_record_sorts_with_the_alert_on_the_same_tensor(tmp_path, capsys):
    # the origin detector numbers its flags apart from the statistic rows (call 70 vs row 12)
    write_dump(
        tmp_path,
        1,
        [
            rec(1, 5, 1, "forward", 0, 12, "blocks.1.fc2.output", "actv", op="infs", value=1.0),
            rec(1, 5, 1, "forward", 0, 13, "blocks.1.output", "actv", op="infs", value=1.0),
            rec(
                1, 5, 1, "forward", 0, 70, "blocks.1.fc2.output", "actv", rule="NanOrigin", op="nonfinite", value="nan"
            ),
        ],
    )
    assert run_analyse(str(tmp_path)) == 0
    result = analysed(tmp_path)
    assert [(e["name"], e["rule"]) for e in result["top_k"]] == [
        ("blocks.1.fc2.output", "NanOrigin"),
        ("blocks.1.fc2.output", "AnomalyNan"),
        ("blocks.1.output", "AnomalyNan"),
    ]
    assert (
        "First anomaly: rank 1, step 5, micro-step 1, forward output of blocks.1.fc2 (inf; AnomalyNan). "
        in capsys.readouterr().out
    )
    assert "That is the first non-finite origin" in result["verdict"]


def test_an_origin_record_that_names_its_inf_is_printed_as_inf_and_an_older_one_without_a_value(tmp_path, capsys):
    write_dump(
        tmp_path,
        2,
        [rec(2, 9, 0, "backward", 0, 30, "layers.3.input", "actv_grad", rule="NanOrigin", op="norm", value="inf")],
    )
    assert run_analyse(str(tmp_path)) == 0
    assert "layers.3 (first non-finite, norm=inf; NanOrigin)." in capsys.readouterr().out
    assert analysed(tmp_path)["nan_origin"]["value"] == "inf"
    older = tmp_path / "older"
    write_dump(
        older,
        2,
        [rec(2, 9, 0, "backward", 0, 30, "layers.3.input", "actv_grad", rule="NanOrigin", op="nonfinite", value="nan")],
    )
    assert run_analyse(str(older)) == 0
    printed = capsys.readouterr().out
    assert "(first non-finite; NanOrigin)." in printed and "nan;" not in printed


def test_a_non_finite_value_made_outside_any_module_is_explained_as_such(tmp_path):
    write_dump(tmp_path, 0, [rec(0, 2, 0, "forward", 0, 7, "head.input", "actv", rule="NanOrigin", op="nonfinite")])
    assert run_analyse(str(tmp_path)) == 0
    assert "already non-finite when it reached this module (made outside any module" in analysed(tmp_path)["verdict"]


def test_ranks_that_fail_at_the_same_point_are_named_together(tmp_path, capsys):
    for rank in (0, 1, 2):
        write_dump(tmp_path, rank, [rec(rank, 3, 0, "forward", 0, 4, "emb.output", "actv")])
    assert run_analyse(str(tmp_path)) == 0
    assert "it also shows on ranks 1, 2." in capsys.readouterr().out


def test_msprobe_anomaly_json_is_read_with_micro_steps_from_the_tag_and_parameters_in_their_stage(tmp_path, capsys):
    def msprobe(rank, step, tag, op, call, value, history, rule="AnomalyTurbulence"):
        message = (
            f"Rule {rule} reports anomaly signal in ('{tag}', '{op}') at step {step}, "
            f"current value {value}, history mean {history}."
        )
        return f"{tag}_step_{step}_call_{call}", {
            "rank": rank,
            "step": step,
            "micro_step": 0,
            "pp_stage": rank,
            "vpp_stage": 0,
            "call_id": call,
            "tag_name": tag,
            "message": message,
            "group_mates": [0, 1],
        }

    rank0 = dict(
        [
            msprobe(0, 3, "0:fc1.weight/rank0/param_origin", "norm", 0, 9.5, 1.2),
            msprobe(0, 3, "0:fc1.weight/rank0/post_grad", "norm", 5, 7.0, 0.5),
            msprobe(0, 3, "0:fc1.output:1/rank0/actv", "norm", 9, 42.0, 2.0),
        ]
    )
    rank1 = dict([msprobe(1, 3, "0:fc2.weight/rank1/pre_grad", "min", 1, "nan", 0.1, "AnomalyNan")])
    for rank, data in ((0, rank0), (1, rank1)):
        path = tmp_path / f"rank{rank}" / "anomaly.json"
        path.parent.mkdir()
        path.write_text(json.dumps(data, indent=1))
    assert run_analyse(str(tmp_path)) == 0
    top = analysed(tmp_path)["top_k"]
    assert [(e["rank"], e["name"], e["category"], e["micro_step"], e["stage"]) for e in top] == [
        (0, "fc1.output", "actv", 1, "forward"),
        (1, "fc2.weight", "pre_grad", None, "backward"),
        (0, "fc1.weight", "param_origin", None, "optimizer"),  # msprobe sorted this first of all
        (0, "fc1.weight", "post_grad", None, "optimizer"),
    ]
    assert (top[0]["op"], top[0]["value"], top[0]["history"], top[0]["rule"]) == (
        "norm",
        42.0,
        2.0,
        "AnomalyTurbulence",
    )
    assert (top[1]["op"], top[1]["value"], top[1]["rule"]) == ("min", "nan", "AnomalyNan")


def test_malformed_and_truncated_files_are_reported_by_name_and_skipped(tmp_path, capsys):
    good = write_dump(tmp_path / "node0", 0, [rec(0, 4, 0, "forward", 0, 1, "fc1.output", "actv")])
    torn = write_dump(tmp_path / "node0", 1, [rec(1, 2, 0, "forward", 0, 1, "fc2.output", "actv")])
    with open(torn, "a") as fh:
        fh.write('{"rank": 1, "step": 3, "micro_st')  # the job died mid-write
    garbage = tmp_path / "node1" / "rank2" / "anomaly.jsonl"
    garbage.parent.mkdir(parents=True)
    garbage.write_bytes(b"\x00\xffnot json at all\n[1, 2]\n")
    incomplete = write_dump(tmp_path / "node1", 3, [{"rank": 3, "name": "x", "category": "actv"}])
    broken_msprobe = tmp_path / "node1" / "rank4" / "anomaly.json"
    broken_msprobe.parent.mkdir()
    broken_msprobe.write_text('{"0:fc1.weight/rank4/pre_grad_step_1_call_0": {"rank": 4, "st')
    assert run_analyse(str(tmp_path)) == 0
    err = capsys.readouterr().err
    assert f"{torn} line 2: not valid JSON" in err
    assert f"{garbage} line 1: not valid JSON" in err and f"{garbage} line 2: expected a JSON object" in err
    assert f"{incomplete} line 1: missing 'step'" in err
    assert f"{broken_msprobe}: not valid JSON" in err and "file skipped" in err
    result = analysed(tmp_path)
    assert [(e["rank"], e["step"]) for e in result["top_k"]] == [(1, 2), (0, 4)]
    assert str(good) in result["files"] and len(result["skipped"]) == 5


def test_an_empty_directory_is_a_clear_message_and_exit_1(tmp_path, capsys):
    assert run_analyse(str(tmp_path)) == 1  # no dump at all: the dump was off, or this is not a run
    assert "no anomaly dump under" in capsys.readouterr().err
    assert run_analyse(str(tmp_path / "missing")) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / REPORT_FILE).exists() and not (tmp_path / MSPROBE_ANALYSE_FILE).exists()


def test_a_healthy_run_with_the_dump_on_is_no_anomaly_and_exit_0(tmp_path, capsys):
    (tmp_path / "rank0").mkdir()  # a healthy run leaves empty rank directories
    assert run_analyse(str(tmp_path)) == 0
    assert "No anomaly" in capsys.readouterr().out
    assert json.loads((tmp_path / REPORT_FILE).read_text())["total"] == 0


def test_files_with_no_readable_record_exit_1(tmp_path, capsys):
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "anomaly.jsonl").write_text("garbage\n")
    assert run_analyse(str(tmp_path)) == 1
    assert "no readable anomaly record" in capsys.readouterr().err


def test_step_filter_and_top_k_select_what_is_shown(tmp_path, capsys):
    write_dump(
        tmp_path, 0, [rec(0, s, 0, "forward", 0, c, f"m{s}.{c}.output", "actv") for s in (3, 4, 5) for c in range(4)]
    )
    assert run_analyse(str(tmp_path), top_k=2, steps=[4, 5]) == 0
    result = analysed(tmp_path)
    assert [e["name"] for e in result["top_k"]] == ["m4.0.output", "m4.1.output"]
    assert (result["total"], result["steps"]) == (8, [4, 5])
    capsys.readouterr()
    assert run_analyse(str(tmp_path), output=str(tmp_path / "x.json"), steps=[9]) == 0
    assert "No anomaly in step 9; anomalies were recorded in steps 3-5" in capsys.readouterr().out
    assert json.loads((tmp_path / "x.json").read_text())["top_k"] == []
    assert run_analyse(str(tmp_path), top_k=0) == 2


def test_a_node_directory_copied_twice_is_not_counted_twice(tmp_path):
    records = [rec(0, 1, 0, "forward", 0, 1, "fc1.output", "actv"), rec(0, 1, 0, "forward", 0, 2, "fc2.output", "actv")]
    write_dump(tmp_path / "node0", 0, records)
    write_dump(tmp_path / "node0-copy", 0, records)
    assert run_analyse(str(tmp_path)) == 0
    assert analysed(tmp_path)["total"] == 2


def test_a_file_holding_two_runs_is_flagged(tmp_path, capsys):
    path = write_dump(
        tmp_path,
        0,
        [rec(0, 50, 0, "forward", 0, 1, "a.output", "actv"), rec(0, 10, 0, "forward", 0, 1, "b.output", "actv")],
    )
    assert run_analyse(str(tmp_path)) == 0
    assert f"{path} line 2: the step goes back from 50 to 10" in capsys.readouterr().err


def test_a_record_whose_op_or_another_field_is_not_a_string_is_skipped_and_counted(tmp_path, capsys):
    good = rec(0, 2, 0, "forward", 0, 1, "fc1.output", "actv")
    write_dump(
        tmp_path,
        0,
        [
            {**good, "op": 5},  # op a number: once a traceback in the table
            {**good, "op": ["nans"]},
            {**good, "tag": 7, "name": None},
            {**good, "stage": ["forward"]},
            {**good, "message": {"text": "x"}},
            {**good, "rule": 3},
            good,
        ],
    )
    msprobe = tmp_path / "rank1" / "anomaly.json"
    msprobe.parent.mkdir()
    msprobe.write_text(
        json.dumps({"k": {"rank": 1, "step": 2, "tag_name": "0:fc2.output:0/rank1/actv", "message": ["not", "text"]}})
    )
    assert run_analyse(str(tmp_path)) == 0
    captured = capsys.readouterr()
    assert "msmon analyse: skipped 7 malformed records" in captured.err
    assert "line 1: 'op' must be a string, got 5; line skipped" in captured.err
    assert f"{msprobe} record 'k': 'message' must be a string" in captured.err
    result = analysed(tmp_path)
    assert result["skipped_records"] == 7 and [e["op"] for e in result["top_k"]] == ["nans"]
    assert "Traceback" not in captured.err


def msprobe_layout(path):
    """msprobe's anomaly_analyse.json: {key: GradAnomalyData fields} in its order (a dict)."""
    data = json.loads(path.read_text())
    fields = {"rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "message", "group_mates"}
    assert all(set(record) == fields for record in data.values())
    return data


def test_msprobes_anomaly_analyse_json_holds_the_first_k_records_in_order(tmp_path):
    write_dump(
        tmp_path,
        0,
        [
            rec(
                0,
                7,
                None,
                "optimizer",
                0,
                90,
                "fc1.weight",
                "grad_reduced",
                op="norm",
                value="nan",
                tag="0:fc1.weight/rank0/grad_reduced",
            ),
            rec(0, 7, 0, "forward", 0, 5, "fc1.output", "actv", op="infs", value=3.0, tag="0:fc1.output:0/rank0/actv"),
            rec(
                0,
                7,
                0,
                "forward",
                0,
                5,
                "fc1.output",
                "actv",
                rule="NanOrigin",
                op="nonfinite",
                value="inf",
                tag="0:fc1.output:0/rank0/actv",
            ),
        ],
    )
    write_dump(
        tmp_path,
        1,
        [
            {
                **rec(1, 7, 0, "forward", 1, 2, "fc3.output", "actv", op="norm", value=9.5, rule="AnomalyTurbulence"),
                "history": 1.25,
            }
        ],
    )  # no tag in the record
    assert run_analyse(str(tmp_path), top_k=3) == 0
    data = msprobe_layout(tmp_path / MSPROBE_ANALYSE_FILE)
    report = analysed(tmp_path)
    assert list(data) == [
        "0:fc1.output:0/rank0/actv_step_7_call_5",  # the origin, then the alert on that tensor
        "0:fc1.output:0/rank0/actv_step_7_call_5_AnomalyNan",
        "0:fc3.output:0/rank1/actv_step_7_call_2",
    ]
    assert [(r["rank"], r["tag_name"]) for r in data.values()] == [
        (e["rank"], e["tag"] or r["tag_name"]) for e, r in zip(report["top_k"], data.values())
    ]
    turbulence = data["0:fc3.output:0/rank1/actv_step_7_call_2"]
    assert turbulence == {
        "rank": 1,
        "step": 7,
        "micro_step": 0,
        "pp_stage": 1,
        "vpp_stage": 0,
        "call_id": 2,
        "tag_name": "0:fc3.output:0/rank1/actv",
        "group_mates": [0, 1],
        "message": "Rule AnomalyTurbulence reports anomaly signal in ('0:fc3.output:0/rank1/actv', "
        "'norm') at step 7, current value 9.5, history mean 1.25.",
    }
    # what msprobe's own message parser (msmon reads msprobe dumps with it) gets back
    back = [event_from_msprobe(r) for r in data.values()]
    assert [(e.rule, e.op, e.value, e.history, e.micro_step) for e in back][1:] == [
        ("AnomalyNan", "infs", 3.0, None, 0),
        ("AnomalyTurbulence", "norm", 9.5, 1.25, 0),
    ]
    assert back[0].rule == "NanOrigin" and back[0].op == "nonfinite"


def test_on_msprobes_own_dumps_the_file_is_what_msprobe_writes(tmp_path):
    """The expected file was written by msprobe 26.2.0 itself (`python -m
    msprobe.core.monitor.anomaly_processor -d DIR -o OUT -k 3`) from these two anomaly.json."""

    def msprobe(rank, step, tag, call, value, history, rule="AnomalyTurbulence", pp=0):
        message = (
            f"Rule {rule} reports anomaly signal in ('{tag}', 'norm') at step {step}, current value {value}, "
            f"history mean {history}."
        )
        return f"{tag}_step_{step}_call_{call}", {
            "rank": rank,
            "step": step,
            "micro_step": 0,
            "pp_stage": pp,
            "vpp_stage": 0,
            "call_id": call,
            "tag_name": tag,
            "message": message,
            "group_mates": [0, 1],
        }

    dumps = {
        0: dict(
            [
                msprobe(0, 3, "0:fc1.output:0/rank0/actv", 9, 42.0, 2.0),
                msprobe(0, 2, "0:fc2.output:0/rank0/actv", 4, 5.0, 1.0),
                msprobe(0, 3, "0:fc1.weight/rank0/exp_avg", 11, 7.0, 0.5),
            ]
        ),
        1: dict([msprobe(1, 3, "0:fc0.output:0/rank1/actv", 2, float("nan"), 0.1, "AnomalyNan", pp=1)]),
    }
    for rank, data in dumps.items():
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "anomaly.json").write_text(json.dumps(data, indent=1))
    assert run_analyse(str(tmp_path), top_k=3) == 0
    written = msprobe_layout(tmp_path / MSPROBE_ANALYSE_FILE)
    expected = [
        dumps[0]["0:fc2.output:0/rank0/actv_step_2_call_4"],
        dumps[0]["0:fc1.output:0/rank0/actv_step_3_call_9"],
        dumps[1]["0:fc0.output:0/rank1/actv_step_3_call_2"],
    ]
    assert list(written) == [
        "0:fc2.output:0/rank0/actv_step_2_call_4",
        "0:fc1.output:0/rank0/actv_step_3_call_9",
        "0:fc0.output:0/rank1/actv_step_3_call_2",
    ]
    assert list(written.values()) == expected


def test_a_whole_step_statistic_has_msprobes_micro_step_0(tmp_path):
    write_dump(tmp_path, 0, [rec(0, 3, None, "optimizer", 0, 4, "fc1.weight", "grad_reduced", op="norm", value="nan")])
    assert run_analyse(str(tmp_path)) == 0
    (record,) = msprobe_layout(tmp_path / MSPROBE_ANALYSE_FILE).values()
    assert (record["micro_step"], record["tag_name"]) == (0, "0:fc1.weight/rank0/grad_reduced")
    assert record["message"].endswith("('0:fc1.weight/rank0/grad_reduced', 'norm') at step 3, current value nan.")


@pytest.mark.parametrize(
    "output, report, msprobe",
    [
        (None, "dumps/" + REPORT_FILE, "dumps/" + MSPROBE_ANALYSE_FILE),
        ("out/", "out/" + REPORT_FILE, "out/" + MSPROBE_ANALYSE_FILE),
        ("out/report.json", "out/report.json", "out/" + MSPROBE_ANALYSE_FILE),
        ("out/" + MSPROBE_ANALYSE_FILE, "out/" + REPORT_FILE, "out/" + MSPROBE_ANALYSE_FILE),
    ],
)
def test_msprobes_file_goes_where_msprobe_writes_it_beside_msmons_report(tmp_path, capsys, output, report, msprobe):
    write_dump(tmp_path / "dumps", 0, [rec(0, 1, 0, "forward", 0, 1, "fc1.output", "actv")])
    assert (
        run_analyse(
            str(tmp_path / "dumps"),
            output=str(tmp_path / output) + ("/" if output == "out/" else "") if output else None,
        )
        == 0
    )
    assert analysed(tmp_path, tmp_path / report)["total"] == 1
    assert len(msprobe_layout(tmp_path / msprobe)) == 1
    assert f"Written to {tmp_path / report} (and msprobe's layout to {tmp_path / msprobe})" in capsys.readouterr().out


@pytest.mark.e2e
def test_inf_injected_on_rank_1_at_step_5_is_named_by_dump_ordering_and_verdict(tmp_path, capsys):
    config = tmp_path / "monitor.json"
    config.write_text(
        json.dumps(
            {
                "xy_distribution": True,
                "all_xy": True,
                "wg_distribution": True,
                "format": "csv",
                "ops": ["norm", "min", "max", "mean", "nans", "infs"],
                "alert": {
                    "rules": [
                        {"rule_name": "AnomalyTurbulence", "args": {"threshold": 2.0}},
                        {"rule_name": "AnomalyNan"},
                    ],
                    "dump": True,
                },
            }
        )
    )
    out = tmp_path / "out"
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(ROOT / "tests" / "scripts" / "anomaly_inject_inf.py"),
        str(config),
        "7",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dumps = out / "anomaly_detected"
    rank1 = [json.loads(line) for line in (dumps / "rank1" / "anomaly.jsonl").read_text().splitlines()]
    rank0 = [json.loads(line) for line in (dumps / "rank0" / "anomaly.jsonl").read_text().splitlines()]
    # the dump: nothing before the fault; rank 1 sees it in forward, rank 0 only after the all-reduce
    assert min(r["step"] for r in rank1 + rank0) == 5
    injected = [r for r in rank1 if r["name"] == "blocks.1.fc2.output" and r["rule"] == "AnomalyNan"]
    assert [(r["step"], r["micro_step"], r["stage"], r["op"], r["value"]) for r in injected][0] == (
        5,
        1,
        "forward",
        "infs",
        1.0,
    )
    assert {r["stage"] for r in rank0 if r["step"] == 5} == {"optimizer"}
    # the origin record names the value it found: the norm of a tensor holding an inf is inf, not nan
    origins = [r for r in rank1 if r["rule"] == "NanOrigin"]
    assert [(r["name"], r["op"], r["value"]) for r in origins][0] == ("blocks.1.fc2.output", "norm", "inf")
    capsys.readouterr()
    assert run_analyse(str(dumps), top_k=3) == 0
    printed = capsys.readouterr().out
    assert "First anomaly: rank 1, step 5, micro-step 1, forward output of blocks.1.fc2 (inf" in printed
    assert "nan" not in printed.split("First anomaly:")[1].split(".")[0], "an inf is never called nan"
    assert "rank 0 at step 5 optimizer" in printed
    result = analysed(dumps)
    first = result["first_anomaly"]
    assert (first["rank"], first["step"], first["micro_step"], first["name"]) == (1, 5, 1, "blocks.1.fc2.output")
    origin = result["nan_origin"]
    assert (origin["rank"], origin["step"], origin["name"]) == (1, 5, "blocks.1.fc2.output")
