"""print_struct output and clean stop; config edits picked up while training runs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import torch

from conftest import MLP, ROOT, rank_dir, read_csv_rows
from msmon import TrainerMon
from msmon.config import TensorSpec


def test_print_struct_writes_the_tree_with_the_names_targets_takes_and_stops_cleanly(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"print_struct": True}))
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from conftest import MLP
        from msmon import TrainerMon
        model = torch.nn.Sequential(); model.add_module("block", MLP())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = TrainerMon({str(config)!r}); mon.set_monitor(model, opt)
        for step in range(5):
            model(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
            print("trained step", step, flush=True)
    """)
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, MONITOR_OUTPUT_DIR=str(out)),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "trained step" not in proc.stdout  # stopped inside the first optimizer step
    stop_lines = [l for l in proc.stdout.splitlines() if "stopping after step 0 as print_struct asks" in l]  # noqa: E741
    assert len(stop_lines) == 1
    # the dotted name, as `targets` takes it, indented under its parent
    assert "\n  block.fc1  [input tensor: size=(4, 8), dtype=torch.float32" in proc.stdout
    struct = json.loads((out / "module_struct" / "rank0" / "module_struct.json").read_text())
    printed = [line.split()[0] for line in proc.stdout.splitlines() if line.lstrip().startswith("block")]
    assert printed == list(struct) == ["block", "block.fc1", "block.act", "block.fc2"]
    assert struct["block.fc1"]["input"] == {"config": "tensor", "0": "size=(4, 8), dtype=torch.float32"}
    assert struct["block.fc2"]["output"] == {"config": "tensor", "0": "size=(4, 4), dtype=torch.float32"}
    assert struct["block.fc2"]["output_grad"] == {"config": "tensor", "0": "size=(4, 4), dtype=torch.float32"}
    assert struct["block.act"]["input_grad"]["0"] == "size=(4, 16), dtype=torch.float32"
    for entry in struct.values():
        for slot in entry.values():
            TensorSpec.parse(slot["config"], "printed config")  # what targets accepts


def write_config(path, cfg, stamp):
    path.write_text(json.dumps(cfg))
    os.utime(path, ns=(stamp, stamp))


def train_steps(model, optimizer, n):
    for _ in range(n):
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_config_edits_switch_activations_on_and_off_at_the_next_step(tmp_path, output_dir):
    path = tmp_path / "monitor.json"
    base = {"wg_distribution": True, "format": "csv", "ops": ["norm"]}
    write_config(path, base, 1_000_000_000)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    train_steps(model, optimizer, 2)  # steps 0, 1
    write_config(path, {**base, "xy_distribution": True, "all_xy": True, "ops": ["norm", "max"]}, 2_000_000_000)
    train_steps(model, optimizer, 3)  # step 2 picks it up at its end: 3, 4 recorded
    write_config(path, base, 3_000_000_000)
    train_steps(model, optimizer, 2)  # step 5 is still on, picks the edit up; 6 off
    mon.close()
    out = rank_dir(output_dir)
    assert {int(r["step"]) for r in read_csv_rows(out, "actv")} == {3, 4, 5}
    assert {int(r["step"]) for r in read_csv_rows(out, "grad_reduced")} == set(range(7))


def test_repeated_toggles_do_not_stack_hooks(tmp_path, output_dir):
    path = tmp_path / "monitor.json"
    on = {"wg_distribution": True, "xy_distribution": True, "all_xy": True, "format": "csv", "ops": ["norm"]}
    off = {"wg_distribution": True, "format": "csv", "ops": ["norm"]}
    write_config(path, off, 1_000_000_000)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    counts = []
    for i in range(20):
        write_config(path, on if i % 2 == 0 else off, 2_000_000_000 + i * 1_000_000)
        train_steps(model, optimizer, 1)
        hooks = (
            len(model.fc1._forward_hooks)
            + len(model.fc1._forward_pre_hooks)
            + len(model.fc1.weight._post_accumulate_grad_hooks or {})
        )
        counts.append((i % 2, hooks))
    mon.close()
    assert len({c for c in counts if c[0] == 0}) == 1 and len({c for c in counts if c[0] == 1}) == 1


def test_an_invalid_edit_keeps_the_old_config_and_is_logged_once(tmp_path, output_dir, caplog):
    logging.getLogger("msmon").propagate = True
    caplog.set_level(logging.ERROR, logger="msmon")
    path = tmp_path / "monitor.json"
    good = {"wg_distribution": True, "format": "csv", "ops": ["norm"]}
    write_config(path, good, 1_000_000_000)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    write_config(path, {**good, "ops": ["median"]}, 2_000_000_000)
    train_steps(model, optimizer, 4)
    mon.close()
    errors = [r.getMessage() for r in caplog.records if "edited config is invalid" in r.getMessage()]
    assert len(errors) == 1 and "median" in errors[0]
    assert {int(r["step"]) for r in read_csv_rows(rank_dir(output_dir), "grad_reduced")} == {0, 1, 2, 3}
    assert json.loads(path.read_text())["ops"] == ["median"]  # the user's file is never rewritten


def test_dynamic_on_collects_collect_times_steps_from_the_edit(tmp_path, output_dir, monkeypatch):
    monkeypatch.setenv("DYNAMIC_MONITOR", "True")
    path = tmp_path / "monitor.json"
    cfg = {"wg_distribution": True, "format": "csv", "ops": ["norm"], "collect_times": 2}
    write_config(path, {**cfg, "dynamic_on": False}, 1_000_000_000)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    train_steps(model, optimizer, 3)  # steps 0-2: waiting for dynamic_on
    write_config(path, {**cfg, "dynamic_on": True}, 2_000_000_000)
    train_steps(model, optimizer, 5)  # step 3 picks it up: 4 and 5 recorded
    mon.close()
    assert {int(r["step"]) for r in read_csv_rows(rank_dir(output_dir), "grad_reduced")} == {4, 5}
    assert json.loads(path.read_text())["dynamic_on"] is True


def test_reload_xy_switches_activations(tmp_path, output_dir):
    path = tmp_path / "monitor.json"
    write_config(path, {"format": "csv", "ops": ["norm"]}, 1_000_000_000)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    train_steps(model, optimizer, 1)
    mon.reload_xy(True)
    train_steps(model, optimizer, 1)
    mon.reload_xy(False)
    train_steps(model, optimizer, 1)
    mon.close()
    assert {int(r["step"]) for r in read_csv_rows(rank_dir(output_dir), "actv")} == {1}


def test_an_edit_of_ops_and_format_reopens_the_outputs_without_losing_rows(tmp_path, output_dir):
    path = tmp_path / "monitor.json"
    write_config(
        path, {"wg_distribution": True, "format": "csv", "ops": ["norm"], "step_count_per_record": 10}, 1_000_000_000
    )
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    train_steps(model, optimizer, 2)
    write_config(
        path,
        {
            "wg_distribution": True,
            "format": ["csv", "tensorboard"],
            "ops": ["norm", "max"],
            "step_count_per_record": 10,
        },
        2_000_000_000,
    )
    train_steps(model, optimizer, 3)
    mon.close()
    out = rank_dir(output_dir)
    files = sorted(p.name for p in out.glob("grad_reduced_*.csv"))
    assert files == ["grad_reduced_0-9.csv", "grad_reduced_0-9_from3.csv"]
    rows = read_csv_rows(out, "grad_reduced")
    assert [int(r["step"]) for r in rows if "max" in r] == [3] * 4 + [4] * 4
    assert {int(r["step"]) for r in rows} == {0, 1, 2, 3, 4}
    assert list(out.glob("events.out.tfevents.*"))


def test_a_rank_outside_module_ranks_stops_with_print_struct_instead_of_hanging(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    path = tmp_path / "monitor.json"
    write_config(path, {"print_struct": True, "module_ranks": [1]}, 1_000_000_000)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))  # this process is rank 0
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    model(torch.randn(2, 8)).sum().backward()
    try:
        optimizer.step()
    except SystemExit as stop:
        assert stop.code == 0
    else:
        raise AssertionError("rank 0 kept training while the recording ranks stopped")


def test_new_ops_have_their_compiled_kernels_before_the_next_step_not_inside_its_hooks(
    tmp_path, output_dir, device_path, monkeypatch
):
    """On the accelerator path the compiled pass is built per field set; an edit of `ops` (a
    reload, or the `ops` setter) builds the new set's kernels between steps."""
    from msmon.stats import fused_batch, fused_rows

    monkeypatch.delenv(fused_rows.ENV, raising=False)
    monkeypatch.setattr(fused_rows, "KERNELS_PER_CALL", {})
    path = tmp_path / "monitor.json"
    write_config(path, {"wg_distribution": True, "format": "csv", "ops": ["norm"]}, 1_000_000_000)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)

    def built(ops: list[str]) -> bool:
        return (torch.float32, "cpu", False, fused_batch.fields_of_ops(ops)) in fused_rows.KERNELS_PER_CALL

    train_steps(model, optimizer, 1)
    assert built(["norm"]) and not built(["norm", "max"])
    write_config(path, {"wg_distribution": True, "format": "csv", "ops": ["norm", "max"]}, 2_000_000_000)
    train_steps(model, optimizer, 1)  # picked up at this step's end
    assert built(["norm", "max"])
    mon.ops = ["zeros"]
    assert built(["zeros"])
    mon.close()
