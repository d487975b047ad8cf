"""The accelerator path's statistics (msmon.stats.multi_tensor, MSMON_DEVICE_PATH=1 on the CPU), by
both its routes (the compiled one-pass kernel, msmon.stats.fused_rows, and the `_foreach_*` route
that runs where no compiler is): the same values as a plain per-tensor torch recomputation,
for every layout it reads (separate tensors copied into staging chunks, large tensors read in
place in chunks, tensors sharing one storage read as one span with gaps), with a number of
kernels that does not grow with the number of tensors, and no host read."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from msmon.stats import flat_layout
from msmon.stats.engine import batch_stats

OPS = ["norm", "min", "max", "mean", "zeros", "nans", "infs"]
EPS = 1e-3
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.fixture(autouse=True, params=["compiled", "foreach"])
def route(request, device_path, monkeypatch):
    """Every test here runs the accelerators' code, by each of its two routes."""
    from msmon.stats import fused_rows

    if request.param == "foreach":
        monkeypatch.setenv(fused_rows.ENV, "0")
    else:
        monkeypatch.delenv(fused_rows.ENV, raising=False)
    return request.param


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4096 elements and staging up to 1024: chunk boundaries, large tensors split
    over chunks and full staging chunks, at test sizes."""
    monkeypatch.setattr(flat_layout, "CHUNK", 4096)
    monkeypatch.setattr(flat_layout, "STAGE_MAX", 1024)
    monkeypatch.setattr(flat_layout, "GAP_MIN", 64)


def reference(t: torch.Tensor, eps: float = EPS) -> list[float]:
    """Plain torch, one tensor at a time, in float64 (exact for min, max and the counts)."""
    if t.numel() == 0:
        return [math.nan] * len(OPS)
    x = t.detach().to(torch.float64)
    return [
        torch.linalg.vector_norm(x).item(),
        torch.amin(x).item(),
        torch.amax(x).item(),
        x.sum().item() / x.numel(),
        (x.abs() < eps).sum().item() / x.numel(),
        torch.isnan(x).sum().item(),
        torch.isinf(x).sum().item(),
    ]


def assert_rows_match(tensors: list[torch.Tensor], rows: torch.Tensor, eps: float = EPS) -> None:
    assert rows.shape == (len(tensors), len(OPS)) and rows.dtype == torch.float64
    for t, row in zip(tensors, rows.tolist()):
        expected = reference(t, eps)
        x = t.detach().to(torch.float64)
        scale = x.abs().nan_to_num(posinf=0.0).sum().item() / max(x.numel(), 1)  # sums round like sum |x|
        for op, got, want in zip(OPS, row, expected):
            if math.isnan(want):
                assert math.isnan(got), (op, got, t.dtype)
            elif op in ("min", "max", "zeros", "nans", "infs") or math.isinf(want):
                assert got == want, (op, got, want, t.dtype)  # exact
            elif op == "mean":
                assert abs(got - want) <= 1e-5 * scale + 1e-12, (op, got, want, t.dtype)
            else:
                assert got == pytest.approx(want, rel=1e-5), (op, got, want, t.dtype)


def separate_tensors(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    sizes = [(3, 4), (1,), (100,), (33, 31), (5000,), (2, 3000), (700,)]
    ts = [torch.randn(s, generator=gen).to(dtype) for s in sizes]
    ts[1].zero_()  # all zeros
    ts[2][::7] = 0.0
    ts[2][5] = 1e-4  # below eps: counted as a zero
    ts[3][4, 5] = math.nan
    ts[4][17] = math.inf
    ts[4][18] = -math.inf
    ts[5][1, 2999] = math.nan
    ts[5][0, 0] = math.inf
    return ts


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_separate_tensors_of_every_float_dtype_match_a_plain_torch_recomputation(dtype, small_chunks):
    ts = separate_tensors(dtype, torch.Generator().manual_seed(1))
    assert_rows_match(ts, batch_stats(ts, OPS, EPS))


@pytest.mark.parametrize("ops", [["norm", "min", "max", "mean", "zeros", "nans"], ["max"], ["min"], ["nans"], ["mean"]])
def test_a_subset_of_the_ops_gives_the_same_columns_as_a_plain_torch_recomputation(ops, small_chunks):
    """The compiled pass computes only the fields the ops read: every subset still gives exact rows."""
    ts = separate_tensors(torch.float32, torch.Generator().manual_seed(5))
    rows = batch_stats(ts, ops, EPS)
    assert rows.shape == (len(ts), len(ops))
    for t, row in zip(ts, rows.tolist()):
        want = dict(zip(OPS, reference(t)))
        for op, got in zip(ops, row):
            if math.isnan(want[op]):
                assert math.isnan(got), (op, got)
            else:
                assert got == pytest.approx(want[op], rel=1e-5, abs=1e-6), (op, got, want[op])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_sharing_one_flat_buffer_with_gaps_are_read_as_one_span(dtype, small_chunks):
    gen = torch.Generator().manual_seed(2)
    flat = torch.randn(20_000, generator=gen).to(dtype)
    flat[50] = math.nan  # in a gap: belongs to no tensor, so counted nowhere
    flat[9_000] = math.inf  # in a gap too
    flat[130] = math.nan
    flat[6_000] = -math.inf
    flat[300:340] = 0.0
    views = [
        flat[100:400].view(20, 15),  # gap before it
        flat[400:410],  # adjacent to the one before
        flat[500:8_500].view(80, 100),  # spans chunk boundaries (4096-element chunks)
        flat[9_100:9_101],
        flat[9_200:19_000],
    ]
    chunks = flat_layout.chunks_of(views)
    assert all(c.view is not None for c in chunks), "read in place, never staged"
    assert len({c.view.untyped_storage().data_ptr() for c in chunks}) == 1
    assert_rows_match(views, batch_stats(views, OPS, EPS))


def test_shared_separate_overlapping_and_non_contiguous_tensors_in_one_batch(small_chunks):
    gen = torch.Generator().manual_seed(3)
    flat = torch.randn(12_000, generator=gen)
    flat[2_500] = math.nan
    base = torch.randn(64, 48, generator=gen)
    tensors = [
        flat[0:2_000],
        torch.randn(300, generator=gen),  # separate, staged
        flat[2_000:6_000].view(40, 100),
        flat[1_000:1_500],  # overlaps the first: read on its own
        base.t(),  # transposed: dense, read in any order
        base[:, ::3],  # strided slice: not dense, copied by reshape
        torch.randn(5, generator=gen).expand(7, 5),  # stride 0: elements repeat, must be counted as such
        torch.randn(6_000, generator=gen),  # large separate: read in place over two chunks
        flat[11_000:11_500].view(25, 20).t(),  # a transposed view in the shared storage
    ]
    assert_rows_match(tensors, batch_stats(tensors, OPS, EPS))


def test_empty_tensors_give_nan_rows_and_the_others_keep_their_places():
    ts = [torch.randn(10), torch.empty(0), torch.randn(3, 0), torch.randn(4, 4) - 2]
    rows = batch_stats(ts, OPS, EPS)
    assert torch.isnan(rows[1]).all() and torch.isnan(rows[2]).all()
    assert_rows_match([ts[0], ts[3]], rows[[0, 3]])


def test_a_batch_of_two_dtypes_matches_per_tensor_recomputation():
    gen = torch.Generator().manual_seed(4)
    ts = [torch.randn(50, generator=gen), torch.randn(60, generator=gen).half(), torch.randn(70, generator=gen)]
    assert_rows_match(ts, batch_stats(ts, OPS, EPS))


def test_the_zero_count_compares_as_real_numbers_below_the_dtypes_resolution():
    # eps=1e-8 lies below float16's smallest subnormal: only exact zeros count, as on the host path
    t = torch.tensor([0.0, 6e-8, -0.0, 1.0, 1e-5], dtype=torch.float16)
    rows = batch_stats([t, t.clone(), t.clone(), t.clone()], OPS, 1e-8)
    assert rows[:, OPS.index("zeros")].tolist() == [2 / 5] * 4


def test_a_dtensors_local_shard_is_what_is_read(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(16, 8, generator=torch.Generator().manual_seed(5))
    dt = distribute_tensor(full, mesh, [Shard(0)])
    plain = torch.randn(30)
    rows = batch_stats([dt, plain, plain * 2, plain * 3], OPS, EPS)
    assert_rows_match([full, plain, plain * 2, plain * 3], rows)


class CountOps(TorchDispatchMode):
    """Aten ops dispatched on this thread that compute something (views launch no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if threading.get_ident() == self.thread and not func.is_view:
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def counted(ts: list[torch.Tensor]) -> list[str]:
    """The kernels one batch launches: aten ops, and the compiled pass's kernels (which no
    dispatch mode sees)."""
    from msmon.stats import fused_rows

    batch_stats(ts, OPS, EPS)  # warm: layouts cached as in a repeated step
    before = fused_rows.launched_kernels()
    with CountOps() as mode:
        batch_stats(ts, OPS, EPS)
    return mode.names + ["compiled kernel"] * (fused_rows.launched_kernels() - before)


@pytest.mark.parametrize("layout", ["separate", "shared"])
def test_the_number_of_ops_does_not_grow_with_the_number_of_tensors(layout):
    def batch(n: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(n)
        if layout == "separate":
            return [torch.randn(64, 33, generator=gen) for _ in range(n)]
        flat = torch.randn(n * 2_200, generator=gen)
        return [flat[i * 2_200 : i * 2_200 + 2_100] for i in range(n)]  # 100-element gaps

    few, many = counted(batch(8)), counted(batch(200))
    assert len(many) == len(few)
    assert not {name for name in many if "_local_scalar_dense" in name or "nonzero" in name}


@pytest.fixture
def batched(monkeypatch) -> list[int]:
    """The sizes of the batches the multi-tensor engine is given, with (5000,) and (2, 3000)
    above engine.PER_TENSOR_MIN."""
    from msmon.stats import engine, multi_tensor

    monkeypatch.setattr(engine, "PER_TENSOR_MIN", 2000)
    sizes: list[int] = []
    real = multi_tensor.batch_columns

    def counting(ts, plan, threshold):
        sizes.append(len(ts))
        return real(ts, plan, threshold)

    monkeypatch.setattr(multi_tensor, "batch_columns", counting)
    return sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_largest_tensors_are_read_one_by_one_and_keep_their_rows_places(dtype, small_chunks, batched, monkeypatch):
    """On the `_foreach_*` route (the compiled pass reads every element once: the next test)."""
    from msmon.stats import fused_rows

    monkeypatch.setenv(fused_rows.ENV, "0")
    ts = separate_tensors(dtype, torch.Generator().manual_seed(3))
    assert_rows_match(ts, batch_stats(ts, OPS, EPS))
    assert batched == [len(ts) - 2]  # the two large ones took the per-tensor reductions
    large = [t for t in ts if t.numel() > 2000]
    assert_rows_match(large, batch_stats(large, OPS, EPS))
    assert batched == [len(ts) - 2]


def test_the_compiled_pass_reads_the_largest_tensors_with_the_others(small_chunks, batched, monkeypatch):
    from msmon.stats import fused_rows

    monkeypatch.delenv(fused_rows.ENV, raising=False)
    ts = separate_tensors(torch.float32, torch.Generator().manual_seed(3))
    assert_rows_match(ts, batch_stats(ts, OPS, EPS))
    assert batched == [len(ts)]


def test_the_compiled_route_launches_its_kernels_and_the_foreach_route_none(route):
    from msmon.stats import fused_rows

    before = fused_rows.launched_kernels()
    ts = separate_tensors(torch.float32, torch.Generator().manual_seed(6))
    assert_rows_match(ts, batch_stats(ts, OPS, EPS))
    launched = fused_rows.launched_kernels() - before
    assert (launched > 0) == (route == "compiled"), launched
