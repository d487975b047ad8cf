"""Recorded statistics equal values recomputed independently from the same tensors."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from conftest import ALL_OPS, MLP, assert_row_matches, rank_dir, read_csv_rows, reference_stats, train_steps
from msmon import TrainerMon
from msmon.stats.engine import batch_stats


def run_capturing(model, optimizer, batches, grad_acc):
    """Train while capturing, independently of the monitor, every tensor it should report."""
    captured = []
    for step_batches in batches:
        micro_grads = []
        for x in step_batches:
            model(x).square().mean().backward()
            micro_grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = {
            n: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
            for n, p in model.named_parameters()
        }
        optimizer.zero_grad()
        captured.append(dict(micro=micro_grads, before=before, after=after, state=state))
    return captured


def test_weights_grads_and_moments_equal_independent_statistics(write_config, output_dir):
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    cfg = {
        "wg_distribution": True,
        "param_distribution": True,
        "mv_distribution": True,
        "ur_distribution": True,
        "format": "csv",
        "ops": ALL_OPS,
    }
    mon = TrainerMon(write_config(cfg), params_have_main_grad=False)
    mon.set_monitor(model, optimizer, grad_acc_steps=4)
    batches = [[torch.randn(5, 8) for _ in range(4)] for _ in range(3)]
    captured = run_capturing(model, optimizer, batches, 4)
    mon.close()
    out = rank_dir(output_dir)

    for category, pick in [
        ("grad_unreduced", lambda c, n: c["micro"][-1][n]),
        ("grad_reduced", lambda c, n: c["micro"][-1][n]),
        ("param_origin", lambda c, n: c["before"][n]),
        ("param_updated", lambda c, n: c["after"][n]),
        ("exp_avg", lambda c, n: c["state"][n]["exp_avg"]),
        ("exp_avg_sq", lambda c, n: c["state"][n]["exp_avg_sq"]),
    ]:
        rows = read_csv_rows(out, category)
        assert len(rows) == 3 * 4, (category, len(rows))
        for row in rows:
            c = captured[int(row["step"])]
            assert_row_matches(row, reference_stats(pick(c, row["name"])))

    # update = m_hat / (sqrt(v_hat) + eps), with AdamW's bias corrections
    for row in read_csv_rows(out, "update"):
        s = captured[int(row["step"])]["state"][row["name"]]
        t = float(s["step"])
        m_hat = s["exp_avg"] / (1 - 0.9**t)
        v_hat = s["exp_avg_sq"] / (1 - 0.999**t)
        assert_row_matches(row, reference_stats(m_hat / (v_hat.sqrt() + 1e-8)))


def test_micro_batch_gradients_are_recorded_per_micro_step(write_config, output_dir):
    torch.manual_seed(1)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "monitor_mbs_grad": True, "format": "csv", "ops": ALL_OPS}))
    mon.set_monitor(model, optimizer)  # grad_acc_steps inferred
    batches = [[torch.randn(5, 8) for _ in range(4)] for _ in range(2)]
    captured = run_capturing(model, optimizer, batches, 4)
    mon.close()
    rows = read_csv_rows(rank_dir(output_dir), "grad_unreduced")
    assert {int(r["micro_step"]) for r in rows} == {0, 1, 2, 3}
    assert len(rows) == 2 * 4 * 4
    for row in rows:
        expected = captured[int(row["step"])]["micro"][int(row["micro_step"])][row["name"]]
        assert_row_matches(row, reference_stats(expected))
    assert mon.ctx.grad_acc_steps == 4


def test_inferred_grad_accumulation_records_the_accumulated_gradient(write_config, output_dir):
    torch.manual_seed(2)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv", "ops": ["norm", "max"]}))
    mon.set_monitor(model, optimizer)
    batches = [[torch.randn(5, 8) for _ in range(3)] for _ in range(3)]
    captured = run_capturing(model, optimizer, batches, 3)
    mon.close()
    rows = read_csv_rows(rank_dir(output_dir), "grad_unreduced")
    assert "micro_step" not in rows[0]
    for row in rows:
        assert_row_matches(row, reference_stats(captured[int(row["step"])]["micro"][-1][row["name"]], ["norm", "max"]))


def test_clipped_gradient_is_what_grad_reduced_reports(write_config, output_dir):
    torch.manual_seed(3)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv", "ops": ["norm"]}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    model(torch.randn(5, 8)).square().mean().mul(100).backward()
    raw = {n: p.grad.norm().item() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = {n: p.grad.norm().item() for n, p in model.named_parameters()}
    optimizer.step()
    mon.close()
    out = rank_dir(output_dir)
    for row in read_csv_rows(out, "grad_unreduced"):
        assert float(row["norm"]) == pytest.approx(raw[row["name"]], rel=1e-5)
    for row in read_csv_rows(out, "grad_reduced"):
        assert float(row["norm"]) == pytest.approx(clipped[row["name"]], rel=1e-5, abs=1e-6)


def test_tensorboard_events_read_back_with_tensorboards_reader(write_config, output_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(4)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = TrainerMon(
        write_config(
            {
                "wg_distribution": True,
                "mv_distribution": True,
                "ur_distribution": True,
                "format": "tensorboard",
                "ops": ["norm", "nans"],
            }
        )
    )
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    norms = []
    for _ in range(3):
        model(torch.randn(5, 8)).square().mean().backward()
        norms.append(model.fc1.weight.grad.norm().item())
        optimizer.step()
        optimizer.zero_grad()
    mon.close()
    acc = EventAccumulator(str(rank_dir(output_dir)), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tag = "0:fc1.weight/rank0/grad_reduced_norm"
    assert tag in acc.Tags()["scalars"]
    events = acc.Scalars(tag)
    assert [e.step for e in events] == [0, 1, 2]
    assert [e.value for e in events] == pytest.approx(norms, rel=1e-5)
    assert "0:fc2.bias/rank0/exp_avg_sq_nans" in acc.Tags()["scalars"]
    assert "0:fc1.weight/rank0/update_hist" in acc.Tags()["histograms"]


def test_api_metrics_are_available_at_any_time(write_config, output_dir):
    torch.manual_seed(5)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "api", "ops": ["norm", "min"]}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    model(torch.randn(5, 8)).square().mean().backward()
    expected = model.fc2.bias.grad.norm().item()
    optimizer.step()
    reduced, unreduced = mon.generate_wgrad_metrics()
    assert reduced["0:fc2.bias/rank0/grad_reduced"]["norm"] == pytest.approx(expected, rel=1e-6)
    assert set(unreduced["0:fc2.bias/rank0/grad_unreduced"]) == {"norm", "min"}
    mon.close()


def test_step_window_start_interval_and_collect_times(write_config, output_dir):
    torch.manual_seed(6)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(
        write_config(
            {
                "wg_distribution": True,
                "format": "csv",
                "ops": ["norm"],
                "start_step": 2,
                "step_interval": 3,
                "collect_times": 3,
            }
        )
    )
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    train_steps(model, optimizer, 15)
    mon.close()
    steps = {int(r["step"]) for r in read_csv_rows(rank_dir(output_dir), "grad_reduced")}
    assert steps == {2, 5, 8}
    assert all(not c.handles for c in mon.collectors) or not mon.collectors


def test_collect_times_zero_collects_nothing(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv", "collect_times": 0}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    model(torch.randn(5, 8)).sum().backward()
    optimizer.step()
    mon.close()
    assert read_csv_rows(rank_dir(output_dir), "grad_reduced") == []


def test_parameter_targets_match_whole_name_components(write_config, output_dir):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(11))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"targets": {"layers.1": {}}, "wg_distribution": True, "format": "csv"}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    assert sorted(mp.name for mp in mon.params) == ["layers.1.bias", "layers.1.weight"]
    mon.close()


def test_virtual_pipeline_chunks_are_prefixed_and_staged(write_config, output_dir):
    chunks = [MLP(), MLP()]
    optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "format": ["csv", "api"], "ops": ["norm"]}))
    mon.set_monitor(chunks, optimizer, grad_acc_steps=1)
    x = torch.randn(3, 8)
    chunks[1](torch.nn.functional.pad(chunks[0](x), (0, 4))).sum().backward()
    optimizer.step()
    reduced, _ = mon.generate_wgrad_metrics()
    assert "0:fc1.weight/rank0/grad_reduced" in reduced and "1:fc1.weight/rank0/grad_reduced" in reduced
    mon.close()
    rows = read_csv_rows(rank_dir(output_dir), "grad_reduced")
    assert {(r["vpp_stage"], r["name"]) for r in rows} >= {("0", "fc2.bias"), ("1", "fc2.bias")}


def test_ops_changed_at_run_time_apply_from_the_next_step(write_config, output_dir):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "api", "ops": ["norm"]}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    for step in range(2):
        model(torch.randn(5, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            mon.ops = ["max", "nans"]
    reduced, _ = mon.generate_wgrad_metrics()
    assert set(reduced["0:fc1.weight/rank0/grad_reduced"]) == {"max", "nans"}
    mon.close()


def test_lbfgs_gradients_are_read_after_the_closure(write_config, output_dir):
    torch.manual_seed(7)
    model = MLP()
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=2)
    mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv", "ops": ["norm"]}))
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    x = torch.randn(5, 8)
    first_norms = {}

    def closure():
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        if not first_norms:
            first_norms.update({n: p.grad.norm().item() for n, p in model.named_parameters()})
        return loss

    optimizer.step(closure)
    mon.close()
    rows = read_csv_rows(rank_dir(output_dir), "grad_reduced")
    assert len(rows) == 4
    for row in rows:
        assert float(row["norm"]) == pytest.approx(first_norms[row["name"]], rel=1e-5)


def test_lbfgs_records_every_step_the_gradient_of_its_first_closure_and_says_it_has_no_moments(
    write_config, output_dir, caplog
):
    """LBFGS evaluates its closure up to 25 times a step (max_iter=20); grad_acc_steps is inferred."""
    torch.manual_seed(8)
    model = MLP()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=20)
    mon = TrainerMon(write_config({"wg_distribution": True, "mv_distribution": True, "format": "csv", "ops": ALL_OPS}))
    mon.set_monitor(model, optimizer)
    x = torch.randn(16, 8)
    first_grads, evaluations = [], []

    def closure():
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        evaluations[-1] += 1
        if evaluations[-1] == 1:  # the gradient at the weights the step starts from
            first_grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        return loss

    with caplog.at_level(logging.INFO, logger="msmon"):
        for _ in range(3):
            evaluations.append(0)
            optimizer.step(closure)
    mon.close()
    assert min(evaluations) > 1  # many closures per step
    out = rank_dir(output_dir)
    for category in ("grad_unreduced", "grad_reduced"):
        rows = read_csv_rows(out, category)
        assert {(r["step"], r["name"]) for r in rows} == {
            (str(s), n) for s in range(3) for n, _ in model.named_parameters()
        }, category
        for row in rows:
            assert_row_matches(row, reference_stats(first_grads[int(row["step"])][row["name"]]))
    assert mon.ctx.grad_acc_steps == 1  # closure evaluations are not micro-batches
    said = [r.getMessage() for r in caplog.records if "keeps no Adam moments" in r.getMessage()]
    assert said == [
        "msmon[rank 0]: LBFGS keeps no Adam moments (exp_avg, exp_avg_sq); mv_distribution records nothing for it"
    ]
    assert read_csv_rows(out, "exp_avg") == []


def test_batch_stats_handles_mixed_devices_dtypes_and_empty():
    ts = [
        torch.tensor([1.0, -2.0, float("nan")]),
        torch.zeros(0),
        torch.tensor([3, 4], dtype=torch.int64),
        torch.tensor([0.5, float("inf")], dtype=torch.bfloat16),
    ]
    rows = batch_stats(ts, ["max", "nans", "infs"], 1e-8)
    assert rows.shape == (4, 3)
    assert math.isnan(rows[1, 0].item())
    assert rows[2].tolist() == [4.0, 0.0, 0.0]
    assert rows[0, 1].item() == 1.0 and rows[3, 2].item() == 1.0


def test_tensorboard_gets_one_event_per_step_holding_all_its_values(write_config, output_dir):
    """One event per step (not one per scalar) keeps the writer thread's CPU cost low."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    torch.manual_seed(4)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mon = TrainerMon(
        write_config(
            {"wg_distribution": True, "ur_distribution": True, "format": "tensorboard", "ops": ["norm", "min", "max"]}
        )
    )
    mon.set_monitor(model, optimizer, grad_acc_steps=1)
    train_steps(model, optimizer, 2)
    mon.close()
    (path,) = rank_dir(output_dir).glob("events.out.tfevents.*")
    events = [e for e in EventFileLoader(str(path)).Load() if e.HasField("summary")]
    assert [e.step for e in events] == [0, 1]
    params = len(list(model.parameters()))
    for event in events:
        tags = [v.tag for v in event.summary.value]
        assert len([t for t in tags if t.endswith("grad_reduced_norm")]) == params
        assert len([t for t in tags if t.endswith("update_hist")]) == params


def test_lbfgs_records_activations_of_the_first_closure_only(write_config, output_dir):
    """LBFGS runs its closure many times a step (line search); those later forwards are no
    micro-batch: each step has one micro-step of activations, the first closure's."""
    torch.manual_seed(9)
    model = MLP()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=20)
    mon = TrainerMon(write_config({"xy_distribution": True, "all_xy": True, "format": "csv", "ops": ["norm", "max"]}))
    mon.set_monitor(model, optimizer)
    x = torch.randn(16, 8)
    first_outputs, evaluations = [], []

    def closure():
        optimizer.zero_grad()
        out = model(x)
        evaluations[-1] += 1
        if evaluations[-1] == 1:
            first_outputs.append(out.detach().clone())
        loss = out.square().mean()
        loss.backward()
        return loss

    for _ in range(2):
        evaluations.append(0)
        optimizer.step(closure)
    mon.close()
    assert min(evaluations) > 1
    rows = read_csv_rows(rank_dir(output_dir), "actv")
    assert rows and {r["micro_step"] for r in rows} == {"0"}
    outputs = {int(r["step"]): r for r in rows if r["name"].endswith("fc2.output")}
    assert sorted(outputs) == [0, 1]
    for step, row in outputs.items():
        assert float(row["norm"]) == pytest.approx(first_outputs[step].norm().item(), rel=1e-5)
    grads = read_csv_rows(rank_dir(output_dir), "actv_grad")
    assert grads and {r["micro_step"] for r in grads} == {"0"}
    assert len(grads) == len({(r["step"], r["name"]) for r in grads})
