"""The native one-pass statistics give the torch path's values; they are built once per
machine on first use (at attach, under a file lock), and without a compiler the torch path is
used after one log line."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import ALL_OPS, MLP, ROOT, rank_dir, read_csv_rows, reference_stats, train_steps
from msmon import TrainerMon
from msmon.stats import native
from msmon.stats.engine import batch_stats, tensor_stats
from msmon.stats.inputs import zero_threshold
from msmon.stats.native import build
from msmon.stats.ops import BY_NAME
from msmon.stats.reductions import CHUNK


def _reset():
    native.reset()


@pytest.fixture
def use_native(monkeypatch):
    """The kernel, from the session's cache (built there by the first test that needs it)."""
    monkeypatch.setenv(native.ENV, "1")
    _reset()
    if native.load() is None:
        pytest.fail("the native statistics did not build (a C++ compiler is a test requirement)")
    yield
    monkeypatch.delenv(native.ENV, raising=False)
    _reset()


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    """A cache directory of this test's own, empty (not even created yet)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(build.CACHE_ENV, str(cache))
    return cache


def libraries(cache) -> list[str]:
    return sorted(name for name in os.listdir(cache) if name.endswith(".so")) if os.path.isdir(cache) else []


def native_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "native statistics" in r.getMessage() or "C++ compiler" in r.getMessage()]


def tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    plain = torch.randn(1000, generator=gen)
    edges = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 9.999e-9, 1e-45, -3.0, 2.5])  # eps edges, a denormal
    with_nan = torch.randn(5000, generator=gen)
    with_nan[[3, 77]] = math.nan
    with_inf = torch.randn(300, generator=gen)
    with_inf[5], with_inf[6] = math.inf, -math.inf
    sparse = torch.randn(3 * CHUNK + 17, generator=gen)  # larger than a CPU chunk
    # the kernel runs two chains per block (its halves) and an odd tail: a NaN and an
    # infinity where only the second chain or the tail sees them
    halves = torch.randn(2048 + 1025, generator=gen)
    halves[1024 + 700], halves[2048 + 1024] = -math.inf, math.nan
    sparse[::3] = 0
    return [
        plain,
        edges,
        with_nan,
        with_inf,
        sparse,
        halves,
        torch.randn(64, 64, generator=gen).double(),
        torch.tensor([7.0]),
        1e30 * torch.randn(100, generator=gen),
    ]


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
    rows = native.stats_rows()(
        [t.float() for t in ts],
        zero_threshold(1e-8, torch.float32),
        [4, 2, 5, 3, 0, 6, 1],
        [True, False, False, True, False, False, False],
        False,
        1,
        0,
    )
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


def test_large_calls_are_shared_with_torchs_openmp_team_and_give_the_rows_of_own_threads(use_native, monkeypatch):
    """Torch's team is awake after its last parallel op; the kernel's own threads are the fallback."""
    gen = torch.Generator().manual_seed(6)
    ts = [torch.randn(n, generator=gen) for n in (1 << 20, 3 * (1 << 18) + 5, 9)]
    ts[0][11], ts[1][3] = math.nan, -math.inf
    assert native.load().team  # torch's wheel loads one OpenMP runtime
    assert native.share_elements() == native.TEAM_SHARE
    team_rows = native.stats_rows()(ts, 1e-8, list(range(7)), [False] * 7, False, 4, 1 << 16)
    monkeypatch.setenv(native.TEAM_ENV, "0")
    _reset()
    assert not native.load().team and native.share_elements() == native.OWN_THREADS_SHARE
    own_rows = native.stats_rows()(ts, 1e-8, list(range(7)), [False] * 7, False, 4, 1 << 16)
    one = native.stats_rows()(ts, 1e-8, list(range(7)), [False] * 7, False, 1, 0)
    torch.testing.assert_close(team_rows, own_rows, rtol=0, atol=0, equal_nan=True)  # same cuts, same sums
    assert torch.allclose(team_rows, one, rtol=1e-12, atol=0, equal_nan=True)
    assert torch.equal(team_rows[:, 4:], one[:, 4:])


def test_calls_from_threads_torch_never_ran_on_read_every_share(use_native):
    """Each caller thread gets a team of its own, which may be smaller than asked for: its
    threads then take several shares each, and none is lost."""
    gen = torch.Generator().manual_seed(7)
    ts = [torch.randn(1 << 19, generator=gen) for _ in range(3)]
    rows_of = native.stats_rows()
    one = rows_of(ts, 1e-8, list(range(7)), [False] * 7, False, 1, 0)

    def shared(_: int) -> torch.Tensor:
        return rows_of(ts, 1e-8, list(range(7)), [False] * 7, False, 3, 1 << 16)

    with ThreadPoolExecutor(2) as pool:  # callers outside torch's thread each get a team of their own
        got = list(pool.map(shared, range(4)))
    for rows in got:
        assert torch.allclose(rows, one, rtol=1e-12, atol=0, equal_nan=True)


def test_batch_stats_gives_the_kernel_the_trainings_thread_count_not_the_stat_threads(use_native, monkeypatch):
    """MSMON_STAT_THREADS (1) is for the torch reductions; the kernel shares on the training's
    threads (it once got 1 and never shared)."""
    seen: list[int] = []
    kernel = native.stats_kernel()
    assert kernel is not None
    rows_of = kernel.readable_rows

    def spy(*args):
        seen.append(args[5])
        return rows_of(*args)

    monkeypatch.setattr(kernel, "readable_rows", spy)
    monkeypatch.setenv("MSMON_STAT_THREADS", "1")
    monkeypatch.delenv("MSMON_NATIVE_THREADS", raising=False)
    from msmon.stats import threads

    threads.configure_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native_ops = [op for op in ALL_OPS if BY_NAME[op].native]  # the ops the kernel computes
        batch_stats([torch.randn(1000), torch.randn(10)], native_ops, 1e-8)
    finally:
        torch.set_num_threads(before)
    assert seen == [2]


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


def test_an_integer_tensor_is_read_by_the_kernel_as_exact_floats_and_no_torch_reduction_runs(use_native):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    tokens = torch.randint(-3, 1000, (8, 64))  # a model's input ids
    tokens[0, :5] = 0
    with Ops() as ops:  # the ops the kernel reads for (a derived one, std, is arithmetic on its row)
        row = tensor_stats(tokens, ["norm", "min", "max", "mean", "zeros", "nans", "infs"], 1e-8)
    # the exact float64 copy, read by the kernel; the row is a slice of a block of rows
    assert {name.split(".")[0] for name in ops.names} <= {"_to_copy", "empty", "slice"}
    assert "_to_copy" in {name.split(".")[0] for name in ops.names}
    exact = tokens.double()
    want = [exact.norm().item(), exact.min().item(), exact.max().item(), exact.mean().item()]
    assert row.tolist()[:4] == pytest.approx(want, rel=1e-12)
    assert row.tolist()[4:] == [(tokens == 0).sum().item() / tokens.numel(), 0.0, 0.0]


def test_a_monitored_run_records_the_same_values_with_the_native_kernel(write_config, output_dir, monkeypatch):
    def run(flag: str) -> dict:
        monkeypatch.setenv(native.ENV, flag)
        _reset()
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        mon = TrainerMon(
            write_config(
                {
                    "wg_distribution": True,
                    "mv_distribution": True,
                    "xy_distribution": True,
                    "format": "csv",
                    "ops": ALL_OPS,
                }
            ),
            params_have_main_grad=False,
        )
        mon.set_monitor(model, optimizer)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        mon.close()
        rows = {
            (c, r["name"], r["step"], r.get("micro_step", "")): r
            for c in ("grad_reduced", "exp_avg", "actv")
            for r in read_csv_rows(rank_dir(output_dir), c)
        }
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


def test_the_kernel_function_refuses_tensors_it_cannot_read(use_native):
    base = torch.randn(40, 30)
    for odd in (base.t(), base.bfloat16(), torch.arange(10), torch.empty(0), torch.randn(3, device="meta")):
        with pytest.raises(RuntimeError, match="stats_rows"):
            native.stats_rows()([torch.ones(3), odd], 1e-8, [0], [False], False, 1, 0)
        assert native.readable_rows()([torch.ones(3), odd], 1e-8, [0], [False], False, 1, 0) is None
    with pytest.raises(RuntimeError, match="field index"):
        native.stats_rows()([base], 1e-8, [7], [False], False, 1, 0)
    with pytest.raises(RuntimeError, match="flat output is for one tensor"):
        native.stats_rows()([base, base], 1e-8, [0], [False], True, 1, 0)


def test_a_view_is_read_from_its_own_first_element(use_native):
    base = torch.arange(100, dtype=torch.float32)
    view = base[37:41]  # contiguous, storage offset 37
    assert native.stats_rows()([view], 0.0, [1, 2, 3], [False, False, True], True, 1, 0).tolist() == [37.0, 40.0, 38.5]


def test_by_default_the_kernel_is_built_at_attach_and_never_in_a_hook(
    monkeypatch, empty_cache, write_config, output_dir, caplog
):
    monkeypatch.delenv(native.ENV)
    _reset()
    with caplog.at_level(logging.INFO, logger="msmon"):
        row = tensor_stats(torch.tensor([1.0, -2.0]), ["min", "max"], 1e-8)  # before any attach: not built
        assert row.tolist() == [-2.0, 1.0] and native.stats_rows() is None and not libraries(empty_cache)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv", "ops": ALL_OPS}))
        mon.set_monitor(model, optimizer)  # the first use: built here
        assert native.compiled_here and native.stats_rows() is not None
        assert libraries(empty_cache) == [os.path.basename(native.built_path())]
        train_steps(model, optimizer, 2)
        mon.close()
    built = native_records(caplog)
    assert len(built) == 1 and "built the native statistics in" in built[0].getMessage()
    assert read_csv_rows(rank_dir(output_dir), "grad_reduced")


def test_by_default_a_built_kernel_is_used_and_nothing_is_compiled(use_native, monkeypatch):
    monkeypatch.delenv(native.ENV)
    monkeypatch.setattr(build, "_compile", lambda *a, **k: pytest.fail("a built kernel must not be compiled again"))
    _reset()
    native.prepare()
    assert native.mode() == "auto" and native.stats_rows() is not None and not native.compiled_here
    monkeypatch.setenv(native.ENV, "0")
    _reset()
    native.prepare()
    assert native.stats_rows() is None and native.load() is None


def test_without_a_compiler_training_goes_on_with_torch_reductions_after_one_log_line(
    monkeypatch, empty_cache, tmp_path, write_config, output_dir, caplog
):
    monkeypatch.delenv(native.ENV)
    monkeypatch.setenv("CXX", "/nonexistent")
    no_compiler = tmp_path / "bin"
    no_compiler.mkdir()
    monkeypatch.setenv("PATH", str(no_compiler))
    _reset()
    with caplog.at_level(logging.INFO, logger="msmon"):
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = TrainerMon(write_config({"wg_distribution": True, "format": "csv", "ops": ALL_OPS}))
        mon.set_monitor(model, optimizer)
        train_steps(model, optimizer, 3)
        native.prepare()  # a second monitor's attach: no second line
        mon.close()
    lines = native_records(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "no C++ compiler" in lines[0].getMessage() and "torch reductions" in lines[0].getMessage()
    assert lines[0].levelno == logging.INFO
    assert native.stats_rows() is None and not libraries(empty_cache)
    assert len(read_csv_rows(rank_dir(output_dir), "grad_reduced")) == 3 * 4


def test_without_a_compiler_a_build_of_this_source_by_another_compiler_is_used(use_native, monkeypatch, tmp_path):
    """E.g. built by `msmon build-native` on a login node whose cache the compute nodes share."""
    built = native.built_path()
    monkeypatch.setenv("CXX", "/nonexistent")
    monkeypatch.delenv(native.ENV)
    _reset()
    native.prepare()
    assert native.stats_rows() is not None and native.built_path() == built and not native.compiled_here


def test_two_ranks_attaching_together_on_an_empty_cache_compile_once_and_both_use_the_kernel(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"wg_distribution": True, "format": "csv", "ops": ALL_OPS}))
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != native.ENV}  # the default: auto
    env.update(MONITOR_OUTPUT_DIR=str(tmp_path / "out"), OMP_NUM_THREADS="1", MSMON_CACHE_DIR=str(cache))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(ROOT / "tests" / "scripts" / "native_first_use.py"),
        str(config),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["compiled"] for r in ranks) == [False, True]
    assert all(r["isa"] in ("avx2", "baseline") for r in ranks) and ranks[0]["path"] == ranks[1]["path"]
    assert proc.stderr.count("built the native statistics in") == 1
    name = os.path.basename(ranks[0]["path"])
    assert sorted(os.listdir(cache)) == [name, name + ".lock"]  # no temporary file left behind
    for r in ranks:
        for got, want in zip(r["with_kernel"], r["with_torch"]):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-12)
    for rank in (0, 1):
        assert len(read_csv_rows(rank_dir(tmp_path / "out", rank), "grad_reduced")) == 2 * 4


def test_a_rank_finding_the_build_lock_taken_waits_and_loads_what_the_holder_built(tmp_path, empty_cache):
    path = build.expected_path()
    os.makedirs(empty_cache)
    env = {k: v for k, v in os.environ.items() if k != native.ENV}
    script = (
        "import json; from msmon.stats import native; print('ready', flush=True); native.prepare(); "
        "print(json.dumps({'compiled': native.compiled_here, 'loaded': native.stats_rows() is not None}))"
    )
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        waiter = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        assert waiter.stdout.readline().strip() == "ready"
        time.sleep(2)
        assert waiter.poll() is None, "it did not wait for the lock"
        build._compile(build.compiler(), open(build.SOURCE, "rb").read(), path)
    out, _ = waiter.communicate(timeout=120)
    assert json.loads(out) == {"compiled": False, "loaded": True}
    assert libraries(empty_cache) == [os.path.basename(path)]


def test_the_cache_key_changes_with_the_source_the_flags_and_the_compiler(monkeypatch, tmp_path):
    source = open(build.SOURCE, "rb").read()
    version = build.compiler_version(build.compiler())
    name = build.library_name(source, version)
    assert build.library_name(source + b"// changed\n", version) != name
    assert build.library_name(source, version, build.FLAGS + ("-march=native",)) != name
    assert build.library_name(source, version + " 13.0") != name
    assert build.library_name(source, version) == name  # nothing else: not torch's version
    before = build.expected_path()
    monkeypatch.setenv("CXX", f"{build.compiler()[0]} -DMSMON_SOMETHING")  # options in $CXX may change the code
    assert build.expected_path() != before
    monkeypatch.delenv("CXX")
    changed = tmp_path / "fused_stats.cpp"
    changed.write_bytes(source + b"// a comment\n")
    monkeypatch.setattr(build, "SOURCE", str(changed))
    assert build.expected_path() != before


def test_the_cache_directory_is_msmon_cache_dir_else_xdg_cache_home_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "explicit"))
    assert build.cache_dir() == str(tmp_path / "explicit")
    monkeypatch.delenv(build.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == str(tmp_path / "xdg" / "msmon")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_dir() == str(tmp_path / "home" / ".cache" / "msmon")


def test_statistics_outside_an_attach_never_compile_and_stay_silent(monkeypatch, empty_cache, caplog):
    monkeypatch.delenv(native.ENV)
    monkeypatch.setattr(build, "_compile", lambda *a, **k: pytest.fail("only an attach may build"))
    _reset()
    with caplog.at_level(logging.INFO, logger="msmon"):
        row = tensor_stats(torch.tensor([1.0, -2.0]), ["min", "max"], 1e-8)
        batch_stats([torch.ones(3)], ["norm"], 1e-8)
    assert row.tolist() == [-2.0, 1.0] and native.stats_rows() is None
    assert not caplog.records and not libraries(empty_cache)


def test_msmon_build_native_builds_and_reports_the_kernel(monkeypatch, empty_cache):
    from click.testing import CliRunner

    from msmon.launcher.cli import main

    first = CliRunner().invoke(main, ["build-native"])
    assert first.exit_code == 0, first.output
    assert "built in" in first.output and native.built_path() in first.output and native.isa() in first.output
    _reset()
    again = CliRunner().invoke(main, ["build-native"])
    assert again.exit_code == 0 and "already built" in again.output
    assert libraries(empty_cache) == [os.path.basename(native.built_path())]


@pytest.mark.parametrize("flag, level", [("1", logging.ERROR), ("", logging.WARNING)])
@pytest.mark.parametrize("broken", ["missing", "not C++"])
def test_a_failed_build_is_logged_once_and_the_torch_path_is_used(
    monkeypatch, caplog, tmp_path, empty_cache, flag, level, broken
):
    source = tmp_path / "fused_stats.cpp"
    if broken == "not C++":
        source.write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCE", str(source))
    monkeypatch.setenv(native.ENV, flag)
    _reset()
    with caplog.at_level(logging.INFO, logger="msmon"):
        native.prepare()
        row = tensor_stats(torch.tensor([1.0, -2.0]), ["min", "max"], 1e-8)
        tensor_stats(torch.tensor([3.0]), ["min"], 1e-8)
        native.prepare()
    assert row.tolist() == [-2.0, 1.0] and native.stats_rows() is None
    lines = native_records(caplog)
    assert len(lines) == 1 and "using torch reductions" in lines[0].getMessage() and lines[0].levelno == level
    assert (native.ENV in lines[0].getMessage()) == (flag == "1")
    assert not libraries(empty_cache)


def test_a_corrupt_file_in_the_cache_is_logged_once_and_the_torch_path_is_used(monkeypatch, empty_cache, caplog):
    os.makedirs(empty_cache)
    with open(build.expected_path(), "wb") as fh:
        fh.write(b"not a shared library")
    monkeypatch.delenv(native.ENV)
    _reset()
    with caplog.at_level(logging.INFO, logger="msmon"):
        row = tensor_stats(torch.tensor([1.0, -2.0]), ["min", "max"], 1e-8)  # looks in the cache
        native.prepare()  # the attach
        native.prepare()
    assert row.tolist() == [-2.0, 1.0] and native.stats_rows() is None
    lines = native_records(caplog)
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "using torch reductions" in lines[0].getMessage()


def test_single_tensor_rows_share_blocks_and_keep_their_values_across_later_calls_and_blocks(use_native):
    """One row per activation and hook: written into views of a few blocks (not a tensor each,
    which fragmented the heap), never overwritten by later calls, across block boundaries."""
    width = 3
    calls = native.ROW_SLAB_ELEMENTS // width + 40  # past the end of the first block
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(int(torch.randint(1, 50, (1,), generator=gen)), generator=gen) for _ in range(calls)]
    rows = [native.stats_rows()([t], 0.0, [1, 2, 3], [False, False, True], True, 1, 0) for t in inputs]
    for t, row in zip(inputs, rows):
        want = [t.min().item(), t.max().item(), t.double().mean().item()]
        assert row.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)  # the sum accumulates in float32
    blocks = {row.untyped_storage().data_ptr() for row in rows}
    assert len(blocks) == 2
    batch = native.stats_rows()(inputs[:5], 0.0, [1, 2], [False, False], False, 1, 0)
    assert batch.untyped_storage().data_ptr() not in blocks  # a batch's rows are their own tensor
