"""`alert.on_nan: "stop"` and AnomalyNan fire on non-finite tensors, never on finite training
data: not on a derived value that is undefined (the gradient agreement's cos of a rank whose
local gradient is exactly zero: 0/0), nor on a norm that overflowed float32 on a tensor whose
min and max prove it finite (a gradient scaled by a large GradScaler scale)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import MLP
from msmon import TrainerMon
from msmon.anomaly.rules import AnomalyNan
from msmon.collectors.grads import agreement
from msmon.records.rows import RowKey
from msmon.runtime.nan_stop import has_nonfinite
from msmon.runtime.transfer import stage_to_host

OPS = ["norm", "min", "max"]


def host_batch(rows: dict[RowKey, list[float]], flags: list[bool] | None = None):
    keys = list(rows)
    values = torch.tensor([rows[k] for k in keys], dtype=torch.float64)
    flag_keys = keys[: len(flags)] if flags else None
    return stage_to_host(keys, [values], len(OPS), [], flag_keys, torch.tensor(flags) if flags else None)


def test_a_zero_local_gradient_has_an_undefined_cos_recorded_as_nan_and_a_ratio_of_zero():
    reduced = [torch.randn(4, 3), torch.randn(3)]
    local = [torch.zeros(4, 3), torch.zeros(3)]
    cos, ratio = agreement.agreement(local, reduced)
    assert math.isnan(float(cos)) and float(ratio) == 0.0


def test_the_stop_ignores_an_undefined_agreement_and_an_overflowed_norm_but_not_a_non_finite_tensor():
    nan, inf = math.nan, math.inf
    agreement_cos = RowKey("grad_agreement", "model", 0, None, op="cos")
    agreement_ratio = RowKey("grad_agreement", "model", 0, None, op="norm_ratio")
    scaled = RowKey("grad_unreduced", "fc1.weight", 0, None)
    healthy = {agreement_cos: [nan] * 3, agreement_ratio: [0.0] * 3, scaled: [inf, -3e37, 3e37]}
    assert not has_nonfinite(host_batch(healthy), OPS)
    assert has_nonfinite(host_batch({**healthy, RowKey("grad_unreduced", "fc2.weight", 0, None): [nan] * 3}), OPS)
    assert has_nonfinite(host_batch({**healthy, scaled: [inf, -inf, 3e37]}), OPS)  # an inf element
    assert has_nonfinite(host_batch({**healthy, RowKey("loss", "loss", 0, 0, op="value"): [nan] * 3}), OPS)
    assert has_nonfinite(host_batch(healthy, flags=[True, False]), OPS)  # the non-finite origin's flag
    # ops that cannot tell a finite tensor (a norm alone): a non-finite norm still counts
    assert has_nonfinite(host_batch({RowKey("grad_unreduced", "fc1.weight", 0, None): [inf]}), ["norm"])


def test_anomaly_nan_leaves_an_overflowed_norm_of_a_finite_tensor_to_the_threshold():
    rule = AnomalyNan()
    assert rule.check_row(OPS, [math.inf, -3e37, 3e37]) is None
    assert rule.check_row(OPS, [math.inf, -math.inf, 3e37]).op == "norm"
    assert rule.check_row(["norm", "nans", "infs"], [math.inf, 0, 0]) is None
    assert rule.check_row(["norm", "nans", "infs"], [math.inf, 0, 2]).op == "infs"
    assert rule.check_row(["norm"], [math.inf]).op == "norm"  # nothing proves it finite
    assert AnomalyNan(threshold=1e30).check_row(OPS, [math.inf, -3e37, 3e37]).text.startswith("|norm|=inf")


def test_a_large_grad_scaler_scale_whose_scaled_norms_overflow_neither_stops_nor_alerts(write_config, output_dir):
    """One process, on_nan "stop": every scaled gradient element is finite (the GradScaler's
    step goes ahead), but the float32 norm of the scaled gradient overflows. Training runs to
    its end, as it does plainly, with no alert."""
    config = {"wg_distribution": True, "format": "csv", "ops": OPS}
    config["alert"] = {"rules": [{"rule_name": "AnomalyNan"}], "dump": True, "on_nan": "stop"}

    def train(monitored: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = TrainerMon(write_config(config)) if monitored else None
        if mon is not None:
            mon.set_monitor(model, optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
        for _ in range(3):
            scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
            assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            assert not all(bool(torch.isfinite(p.grad.norm())) for p in model.parameters())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        if mon is not None:
            mon.close()
        return {k: v.clone() for k, v in model.state_dict().items()}

    plain = train(False)
    monitored = train(True)
    assert all(torch.equal(monitored[k], plain[k]) for k in plain)
    (rank_dir,) = output_dir.glob("*-rank0-*")
    summary = json.loads((rank_dir / "summary.json").read_text())
    assert summary["steps_recorded"] == 3 and summary["alerts"] == 0


@pytest.mark.parametrize("rows_of", ["grad_agreement", "attention_hook"])
def test_derived_values_never_count_as_non_finite(rows_of):
    key = RowKey(rows_of, "x", 0, None, op="cos" if rows_of == "grad_agreement" else "entropy")
    assert not has_nonfinite(host_batch({key: [math.nan] * 3}), OPS)
