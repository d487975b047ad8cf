"""The optional one-pass native statistics (MSMON_NATIVE_STATS=1) give the torch path's values,
and a failed build falls back to torch with one warning."""
from __future__ import annotations

import logging
import math
import os
import shutil

import pytest
import torch

from msmon import TrainerMon, native
from msmon.stats import CHUNK, batch_stats, tensor_stats, zero_threshold

from conftest import ALL_OPS, MLP, rank_dir, read_csv_rows, reference_stats


def _reset():
    native._loaded, native._tried = None, False


@pytest.fixture
def use_native(monkeypatch):
    monkeypatch.setenv(native.ENV, "1")
    _reset()
    if native.load() is None:
        pytest.fail("the native statistics did not build (a C++ compiler and ninja are test requirements)")
    yield
    monkeypatch.delenv(native.ENV, raising=False)
    _reset()


def tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    plain = torch.randn(1000, generator=gen)
    edges = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 9.999e-9, 1e-45, -3.0, 2.5])  # eps edges, a denormal
    with_nan = torch.randn(5000, generator=gen)
    with_nan[[3, 77]] = math.nan
    with_inf = torch.randn(300, generator=gen)
    with_inf[5], with_inf[6] = math.inf, -math.inf
    sparse = torch.randn(3 * CHUNK + 17, generator=gen)  # larger than a CPU chunk
    sparse[::3] = 0
    return [plain, edges, with_nan, with_inf, sparse, torch.randn(64, 64, generator=gen).double(),
            torch.tensor([7.0]), 1e30 * torch.randn(100, generator=gen)]


def assert_rows_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float64
    for g, w, op in zip(got.tolist(), want.tolist(), ALL_OPS * len(got)):
        if math.isnan(w):
            assert math.isnan(g), op
        else:
            assert g == pytest.approx(w, rel=1e-5, abs=1e-12), op  # float32 accumulation either way


def test_native_rows_equal_the_torch_rows(use_native, monkeypatch):
    ts = tensors()
    got = [tensor_stats(t, ALL_OPS, 1e-8) for t in ts]
    batch = batch_stats(ts, ALL_OPS, 1e-8)
    monkeypatch.setenv(native.ENV, "0")
    _reset()
    for t, row, batched in zip(ts, got, batch):
        want = tensor_stats(t, ALL_OPS, 1e-8)
        assert_rows_equal(row, want)
        assert_rows_equal(batched, want)


def test_one_kernel_call_gives_finished_rows_in_any_op_order(use_native):
    ts = tensors()[:-1]  # not the 1e30 one: its float32 norm overflows where the float64 reference does not
    ops = ["zeros", "max", "nans", "mean", "norm", "infs", "min"]
    rows = native.stats_rows()([t.float() for t in ts], zero_threshold(1e-8, torch.float32), [4, 2, 5, 3, 0, 6, 1], [True, False, False, True,
                                                                                   False, False, False], False, 1, 0)
    assert rows.shape == (len(ts), len(ops))
    for t, row in zip(ts, rows):
        want = torch.tensor([reference_stats(t.float(), ops)[op] for op in ops], dtype=torch.float64)
        assert_rows_equal(row, want)
    assert native.isa() in ("avx2", "baseline")


def test_threads_share_the_reading_without_changing_the_rows(use_native):
    gen = torch.Generator().manual_seed(5)
    ts = [torch.randn(n, generator=gen) for n in (5, 1 << 18, 3 * (1 << 18) + 17, 1000, 1 << 20, 7)]
    ts[2][100], ts[4][5], ts[1][7] = math.nan, math.inf, 0.0
    rows_of = native.stats_rows()
    one = rows_of(ts, 1e-8, list(range(7)), [False] * 7, False, 1, 0)
    for threads in (2, 3, 8):
        shared = rows_of(ts, 1e-8, list(range(7)), [False] * 7, False, threads, 1 << 16)
        assert torch.allclose(shared, one, rtol=1e-12, atol=0, equal_nan=True)
        assert torch.equal(shared[:, 1:3].nan_to_num(), one[:, 1:3].nan_to_num())  # min, max exact
        assert torch.equal(shared[:, 4:], one[:, 4:])  # counts exact


def test_the_native_path_reads_tensors_that_require_grad_without_recording_autograd(use_native):
    x = torch.randn(300, 7, requires_grad=True)
    y = x * 3
    row = tensor_stats(y, ALL_OPS, 1e-8)
    assert not row.requires_grad and row.grad_fn is None
    assert y.grad_fn is not None and y._version == 0
    assert row.tolist()[0] == pytest.approx(y.detach().norm().item(), rel=1e-6)


def test_a_batch_of_mixed_dtypes_gives_each_dtype_its_own_zero_threshold(use_native):
    tiny = torch.tensor([5e-9, 1.5e-8, 0.0, 1.0])  # 1e-8 rounds differently in float32 and float64
    rows = batch_stats([tiny, tiny.double()], ["zeros"], 1e-8)
    want = [tensor_stats(t, ["zeros"], 1e-8).item() for t in (tiny, tiny.double())]
    assert rows.flatten().tolist() == want == [0.5, 0.5]


def test_tensors_the_kernel_cannot_read_take_the_torch_path(use_native):
    base = torch.randn(40, 30)
    odd = [base.t(), base.bfloat16(), torch.arange(10), torch.empty(0)]  # strided, bf16, integer, empty
    rows = batch_stats(odd, ALL_OPS, 1e-8)
    assert rows[0].tolist()[:3] == pytest.approx([base.norm().item(), base.min().item(), base.max().item()], rel=1e-6)
    assert rows[2].tolist()[3] == pytest.approx(4.5)
    assert all(math.isnan(v) for v in rows[3].tolist())


def test_a_monitored_run_records_the_same_values_with_the_native_kernel(write_config, output_dir, monkeypatch):
    def run(flag: str) -> dict:
        monkeypatch.setenv(native.ENV, flag)
        _reset()
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        mon = TrainerMon(write_config({"wg_distribution": True, "mv_distribution": True, "xy_distribution": True,
                                       "format": "csv", "ops": ALL_OPS}), params_have_main_grad=False)
        mon.set_monitor(model, optimizer)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        mon.close()
        rows = {(c, r["name"], r["step"], r.get("micro_step", "")): r for c in ("grad_reduced", "exp_avg", "actv")
                for r in read_csv_rows(rank_dir(output_dir), c)}
        assert native.stats_rows() is not None if flag == "1" else native.stats_rows() is None
        shutil.rmtree(output_dir)
        return {"losses": losses, "rows": rows}

    with_native, with_torch = run("1"), run("0")
    _reset()
    assert with_native["losses"] == with_torch["losses"]
    assert with_native["rows"].keys() == with_torch["rows"].keys() and with_native["rows"]
    for key, row in with_native["rows"].items():
        for op in ALL_OPS:
            assert float(row[op]) == pytest.approx(float(with_torch["rows"][key][op]), rel=1e-5, abs=1e-9), (key, op)


def test_by_default_a_built_kernel_is_used_and_nothing_is_compiled(use_native, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    assert os.path.exists(native.built_path())
    monkeypatch.delenv(native.ENV)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("auto mode must not build"))
    _reset()
    assert native.mode() == "auto" and native.stats_rows() is not None
    monkeypatch.setenv(native.ENV, "0")
    _reset()
    assert native.stats_rows() is None and native.load() is None


def test_the_built_path_follows_torchs_build_directory_rule(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp_extension

    for root in (None, str(tmp_path)):
        if root is None:
            monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCH_EXTENSIONS_DIR", root)
        want = os.path.join(cpp_extension._get_build_directory(native._NAME, verbose=False), native._NAME + ".so")
        assert native.built_path() == want


def test_by_default_without_a_build_the_torch_path_is_used_silently(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.delenv(native.ENV)
    monkeypatch.setattr(native, "_NAME", "msmon_stats_never_built")
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("auto mode must not build"))
    _reset()
    with caplog.at_level(logging.WARNING, logger="msmon"):
        row = tensor_stats(torch.tensor([1.0, -2.0]), ["min", "max"], 1e-8)
    assert row.tolist() == [-2.0, 1.0] and native.stats_rows() is None
    assert not caplog.records


def test_msmon_build_native_builds_and_reports_the_kernel(use_native):
    from click.testing import CliRunner

    from msmon.launcher.cli import main

    result = CliRunner().invoke(main, ["build-native"])
    assert result.exit_code == 0, result.output
    assert native.built_path() in result.output and native.isa() in result.output


def test_a_failed_build_warns_once_and_the_torch_path_is_used(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv(native.ENV, "1")
    monkeypatch.setattr(native, "_SOURCE", str(tmp_path / "missing.cpp"))
    monkeypatch.setattr(native, "_NAME", "msmon_stats_missing")
    _reset()
    try:
        with caplog.at_level(logging.WARNING, logger="msmon"):
            row = tensor_stats(torch.tensor([1.0, -2.0]), ["min", "max"], 1e-8)
            tensor_stats(torch.tensor([3.0]), ["min"], 1e-8)
        assert row.tolist() == [-2.0, 1.0]
        warnings = [r for r in caplog.records if native.ENV in r.getMessage()]
        assert len(warnings) == 1 and "using torch reductions" in warnings[0].getMessage()
    finally:
        _reset()
