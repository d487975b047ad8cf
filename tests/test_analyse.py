"""`msmon analyse` (run_analyse): cross-rank ordering, the verdict, both dump layouts, bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from msmon.anomaly.analyse import ANALYSE_FILE, run_analyse


def rec(rank, step, micro, stage, pp, call, name, category, vpp=0, rule="AnomalyNan", op="nans", value=1.0, **extra):
    return dict(rank=rank, step=step, micro_step=micro, pp_stage=pp, vpp_stage=vpp, stage=stage, call_id=call,
                name=name, category=category, op=op, value=value, history=None, rule=rule, message="",
                group_mates=[0, 1], **extra)


def write_dump(directory, rank, records, name="anomaly.jsonl"):
    path = directory / f"rank{rank}" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return path


def analysed(directory, output=None):
    path = directory / ANALYSE_FILE if output is None else output
    return json.loads(path.read_text())


def order_of(result):
    return [(e["rank"], e["step"], e["micro_step"], e["stage"], e["name"]) for e in result["top_k"]]


def test_two_stage_pipeline_events_are_ordered_in_training_time(tmp_path, capsys):
    # rank 0 is pipeline stage 0, rank 1 stage 1; events written in a scrambled order
    write_dump(tmp_path, 0, [
        rec(0, 7, None, "optimizer", 0, 90, "fc1.weight", "grad_reduced"),
        rec(0, 7, 0, "backward", 0, 30, "fc1.output", "actv_grad"),
        rec(0, 7, 1, "forward", 0, 40, "fc1.output", "actv"),
        rec(0, 7, 0, "forward", 0, 5, "fc1.output", "actv"),
        rec(0, 7, None, "backward", 0, 60, "fc1.weight", "grad_unreduced"),
        rec(0, 6, 1, "optimizer", 0, 99, "late.weight", "param_origin"),
    ])
    write_dump(tmp_path, 1, [
        rec(1, 7, 0, "backward", 1, 20, "fc3.output", "actv_grad"),
        rec(1, 7, 0, "forward", 1, 3, "fc3.output", "actv"),
        rec(1, 7, 0, "forward", 1, 2, "fc3.input", "actv"),
    ])
    assert run_analyse(str(tmp_path), top_k=20) == 0
    assert order_of(analysed(tmp_path)) == [
        (0, 6, 1, "optimizer", "late.weight"),        # an earlier step first, whatever its stage
        (0, 7, 0, "forward", "fc1.output"),           # forward: stage 0 before stage 1
        (1, 7, 0, "forward", "fc3.input"),            # then by call order within the rank
        (1, 7, 0, "forward", "fc3.output"),
        (1, 7, 0, "backward", "fc3.output"),          # backward: the last stage first
        (0, 7, 0, "backward", "fc1.output"),
        (0, 7, 1, "forward", "fc1.output"),           # micro-step 1 after all of micro-step 0
        (0, 7, None, "backward", "fc1.weight"),       # whole-step statistics after every micro-step
        (0, 7, None, "optimizer", "fc1.weight"),
    ]
    out = capsys.readouterr().out
    assert "First anomaly: rank 0, step 6, micro-step 1, weight late.weight before the update (nans" in out


def test_virtual_pipeline_chunks_order_before_pipeline_stages_and_reverse_in_backward(tmp_path):
    events = [rec(r, 1, 0, stage, pp, 0, f"{stage}.v{vpp}.p{pp}", "actv" if stage == "forward" else "actv_grad",
                  vpp=vpp) for r, pp in ((0, 0), (1, 1)) for vpp in (0, 1) for stage in ("forward", "backward")]
    for rank in (0, 1):
        write_dump(tmp_path, rank, [e for e in events if e["rank"] == rank])
    assert run_analyse(str(tmp_path), top_k=8) == 0
    assert [e["name"] for e in analysed(tmp_path)["top_k"]] == [
        "forward.v0.p0", "forward.v0.p1", "forward.v1.p0", "forward.v1.p1",
        "backward.v1.p1", "backward.v1.p0", "backward.v0.p1", "backward.v0.p0"]


def test_the_verdict_names_the_first_anomaly_the_spread_and_the_first_non_finite_origin(tmp_path, capsys):
    write_dump(tmp_path, 3, [
        rec(3, 41210, 2, "forward", 0, 11, "layers.17.mlp.fc2.output", "actv", op="nans", value=12.0),
        rec(3, 41210, 2, "forward", 0, 12, "layers.18.input", "actv"),
    ])
    write_dump(tmp_path, 5, [
        rec(5, 41210, None, "optimizer", 0, 3, "layers.0.fc1.weight", "grad_reduced", op="norm", value="nan"),
        rec(5, 41210, 0, "backward", 0, 40, "layers.2.attn.input", "actv_grad", rule="NanOrigin", op="nonfinite",
            value="nan"),
    ])
    (tmp_path / "result").mkdir()
    assert run_analyse(str(tmp_path), output=str(tmp_path / "result")) == 0
    out = capsys.readouterr().out
    assert ("First anomaly: rank 5, step 41210, micro-step 0, backward input gradient of layers.2.attn "
            "(first non-finite; NanOrigin).") in out
    result = analysed(tmp_path, tmp_path / "result" / ANALYSE_FILE)
    assert result["nan_origin"]["name"] == "layers.2.attn.input"
    assert result["first_per_rank"]["3"]["description"] == \
        "rank 3, step 41210, micro-step 2, forward: forward output of layers.17.mlp.fc2 (nans)"
    assert "Other ranks' first anomalies came later: rank 3 at step 41210 forward" in out
    assert "4 anomalies in all, on 2 ranks, in step 41210." in out


def test_a_nan_origin_record_sorts_with_the_alert_on_the_same_tensor(tmp_path, capsys):
    # the origin detector numbers its flags apart from the statistic rows (call 70 vs row 12)
    write_dump(tmp_path, 1, [
        rec(1, 5, 1, "forward", 0, 12, "blocks.1.fc2.output", "actv", op="infs", value=1.0),
        rec(1, 5, 1, "forward", 0, 13, "blocks.1.output", "actv", op="infs", value=1.0),
        rec(1, 5, 1, "forward", 0, 70, "blocks.1.fc2.output", "actv", rule="NanOrigin", op="nonfinite", value="nan"),
    ])
    assert run_analyse(str(tmp_path)) == 0
    result = analysed(tmp_path)
    assert [(e["name"], e["rule"]) for e in result["top_k"]] == [
        ("blocks.1.fc2.output", "NanOrigin"), ("blocks.1.fc2.output", "AnomalyNan"), ("blocks.1.output", "AnomalyNan")]
    assert ("First anomaly: rank 1, step 5, micro-step 1, forward output of blocks.1.fc2 (inf; AnomalyNan). "
            in capsys.readouterr().out)
    assert "That is the first non-finite origin" in result["verdict"]


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
        message = (f"Rule {rule} reports anomaly signal in ('{tag}', '{op}') at step {step}, "
                   f"current value {value}, history mean {history}.")
        return f"{tag}_step_{step}_call_{call}", {
            "rank": rank, "step": step, "micro_step": 0, "pp_stage": rank, "vpp_stage": 0, "call_id": call,
            "tag_name": tag, "message": message, "group_mates": [0, 1]}

    rank0 = dict([msprobe(0, 3, "0:fc1.weight/rank0/param_origin", "norm", 0, 9.5, 1.2),
                  msprobe(0, 3, "0:fc1.weight/rank0/post_grad", "norm", 5, 7.0, 0.5),
                  msprobe(0, 3, "0:fc1.output:1/rank0/actv", "norm", 9, 42.0, 2.0)])
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
    assert (top[0]["op"], top[0]["value"], top[0]["history"], top[0]["rule"]) == ("norm", 42.0, 2.0, "AnomalyTurbulence")
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
    (tmp_path / "rank0").mkdir()  # a healthy run leaves empty rank directories
    assert run_analyse(str(tmp_path)) == 1
    assert "no anomaly dump under" in capsys.readouterr().err
    assert run_analyse(str(tmp_path / "missing")) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / ANALYSE_FILE).exists()


def test_files_with_no_readable_record_exit_1(tmp_path, capsys):
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "anomaly.jsonl").write_text("garbage\n")
    assert run_analyse(str(tmp_path)) == 1
    assert "no readable anomaly record" in capsys.readouterr().err


def test_step_filter_and_top_k_select_what_is_shown(tmp_path, capsys):
    write_dump(tmp_path, 0, [rec(0, s, 0, "forward", 0, c, f"m{s}.{c}.output", "actv") for s in (3, 4, 5) for c in range(4)])
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
    path = write_dump(tmp_path, 0, [rec(0, 50, 0, "forward", 0, 1, "a.output", "actv"),
                                    rec(0, 10, 0, "forward", 0, 1, "b.output", "actv")])
    assert run_analyse(str(tmp_path)) == 0
    assert f"{path} line 2: the step goes back from 50 to 10" in capsys.readouterr().err


@pytest.mark.e2e
def test_inf_injected_on_rank_1_at_step_5_is_named_by_dump_ordering_and_verdict(tmp_path, capsys):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({
        "xy_distribution": True, "all_xy": True, "wg_distribution": True, "format": "csv",
        "ops": ["norm", "min", "max", "mean", "nans", "infs"],
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 2.0}},
                            {"rule_name": "AnomalyNan"}], "dump": True}}))
    out = tmp_path / "out"
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(out), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(ROOT / "tests" / "scripts" / "anomaly_inject_inf.py"), str(config), "7"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dumps = out / "anomaly_detected"
    rank1 = [json.loads(line) for line in (dumps / "rank1" / "anomaly.jsonl").read_text().splitlines()]
    rank0 = [json.loads(line) for line in (dumps / "rank0" / "anomaly.jsonl").read_text().splitlines()]
    # the dump: nothing before the fault; rank 1 sees it in forward, rank 0 only after the all-reduce
    assert min(r["step"] for r in rank1 + rank0) == 5
    injected = [r for r in rank1 if r["name"] == "blocks.1.fc2.output" and r["rule"] == "AnomalyNan"]
    assert [(r["step"], r["micro_step"], r["stage"], r["op"], r["value"]) for r in injected][0] == \
        (5, 1, "forward", "infs", 1.0)
    assert {r["stage"] for r in rank0 if r["step"] == 5} == {"optimizer"}
    capsys.readouterr()
    assert run_analyse(str(dumps), top_k=3) == 0
    printed = capsys.readouterr().out
    assert "First anomaly: rank 1, step 5, micro-step 1, forward output of blocks.1.fc2 (inf" in printed
    assert "rank 0 at step 5 optimizer" in printed
    result = analysed(dumps)
    first = result["first_anomaly"]
    assert (first["rank"], first["step"], first["micro_step"], first["name"]) == (1, 5, 1, "blocks.1.fc2.output")
    origin = result["nan_origin"]
    assert (origin["rank"], origin["step"], origin["name"]) == (1, 5, "blocks.1.fc2.output")
