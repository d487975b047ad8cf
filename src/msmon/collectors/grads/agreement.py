"""Gradient agreement (`grad_agreement`): how far a rank's own gradient points where the
data-parallel average does.

Per rank and step, over every monitored parameter the data-parallel reduction averages:
    cos        = <local, reduced> / (|local| |reduced|)
    norm_ratio = |local| / |reduced|
`local` is the rank-local gradient of the step (grad_unreduced's tensor), `reduced` the whole
average the reduction leaves on this rank. Ranks fed similar data have cos near 1 and a ratio
near 1 (more when their batches are noisy: the average cancels noise). Read the two together: a
rank whose gradient outweighs the others' makes the average its own, so its cos stays high while
the others' fall; its norm_ratio points at it (anomaly/agreement.py, docs/loss.md). No collective
is added: both tensors are on this rank.

Where a rank holds both (docs/loss.md has the table): under torch DDP (grads.py copies the local
gradient in the post-accumulate hook of the backward pass DDP reduces, and takes the sums once
DDP's end-of-backward work has run), and where a framework reduces whole gradients itself in
place (`Framework.whole_gradient_reduction`: DeepSpeed's stage-0 engine, Megatron's DDP without
the distributed optimizer, FSDP1 NO_SHARD), copied right before that reduction and summed right
after. Both
tensors are then in the same scale and nothing has clipped them yet.

What it costs: the reduction overwrites the local gradient, so it is copied first: one float32
copy of the monitored gradients (LocalCopies: views of one flat buffer per device, kept across
steps), on recorded steps, which is why the key is off by default. The sums are of the whole
concatenation, so only three totals are needed: the local norm, taken from grad_unreduced's row
of the same tensor where one was computed in the same pass; on an accelerator the dot product,
one in-place `_foreach_mul_` of the copy (spent afterwards) and one sum per flat buffer, and
the reduced norm, one `_foreach_norm`: a few kernels whatever the parameter count. On the CPU,
per parameter the dot product and then the reduced tensor's own, which finds it in the cache:
the reduced norm costs a fraction of a pass of its own there (docs/performance.md).

The reduced norm is not taken from grad_reduced's rows of the step, although they usually
hold it: those are read at the optimizer step, and nothing tells reliably whether `.grad` was
rewritten in between. Its version counter does not move under a GradScaler's `unscale_`
(`_amp_foreach_non_finite_check_and_unscale_`) nor under writes through `.data`, so the rows of
an unscaled or clipped gradient would pass for the reduced one.

Not available, said once in the log: a single process (the local gradient is the reduced one);
a rank that keeps only a shard of the reduced gradient (DeepSpeed ZeRO-1/2/3, Megatron's
distributed optimizer, sharded FSDP); reductions msmon does not follow in this version
(DeepSpeed's BF16_Optimizer, FSDP NO_SHARD beside sharded units or over flat parameters); a step
that reduces a gradient twice (its local gradient is gone); and data parallelism with none of
these (a manual all-reduce), where nothing tells when the reduction happens.
"""

from __future__ import annotations

import logging

import torch

from ...records.rows import RowKey
from ...stats.device_path import host_code

logger = logging.getLogger("msmon")

CATEGORY, NAME = "grad_agreement", "model"


_SHARD = "a rank holds only its shard of the reduced gradient"
_MEGATRON = (
    "under Megatron msmon follows the grad sync of Megatron's DistributedDataParallel without the "
    "distributed optimizer (its bucket groups all-reduce main_grad); here the distributed optimizer "
    "reduce-scatters (" + _SHARD + "), or no such module wraps the model chunks"
)
_FSDP = (
    "FSDP reduce-scatters the gradient (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD): " + _SHARD + "; NO_SHARD "
    "is followed only where every unit is NO_SHARD with use_orig_params=True"
)
# why a rank holds no whole reduced gradient beside its local one, by the adapter of the optimizer
_NOT_WHOLE = {
    "Zero12Adapter": (
        "DeepSpeed ZeRO-1/2 copies each reduced bucket back only into the slices of the partition this "
        "rank owns, so no rank holds the whole reduced gradient"
    ),
    "Zero3Adapter": "DeepSpeed ZeRO-3 partitions the gradient itself: " + _SHARD,
    "BF16Adapter": (
        "DeepSpeed's BF16_Optimizer reduces its own fp32 accumulation buffers, which msmon does not follow "
        "for the agreement in this version"
    ),
    "DistributedAdapter": "Megatron's distributed optimizer reduce-scatters the gradient: " + _SHARD,
    "ChainedAdapter": _MEGATRON,
    "FP32Adapter": _MEGATRON,
    "Float16Adapter": _MEGATRON,
    "Fsdp2Adapter": "FSDP2 reduce-scatters the gradient: " + _SHARD,
    "Fsdp1Adapter": _FSDP,
    "Fsdp1FlatAdapter": _FSDP,
}


def unavailable(data_parallel: bool, hooks_unreduced: bool, adapter_name: str) -> str | None:
    """Why the agreement cannot be recorded here, None when it can."""
    if not data_parallel:
        return "a single process: its local gradient is the reduced one"
    if hooks_unreduced:
        return _NOT_WHOLE.get(
            adapter_name,
            f"{adapter_name} reduces gradients in its own buffers or keeps only a shard of the reduced gradient",
        )
    return None


def _copy_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 gradients are copied as they are, every other floating type in float32: the
    products and sums then keep float32's accuracy whatever the training's precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fits(view: torch.Tensor | None, grad: torch.Tensor) -> bool:
    return (
        view is not None
        and view.shape == grad.shape
        and view.device == grad.device
        and view.dtype == _copy_dtype(grad.dtype)
    )


class LocalCopies:
    """The agreement's copies of the rank-local gradients: views of one flat buffer per device
    and copy dtype, laid out over the monitored parameters at the first copy and kept across
    steps. A copy into a view allocates nothing (a fresh gradient-sized allocation is first-touch
    page faults on a CPU, which cost more than the copy), and the dot product of a flat buffer is
    one in-place multiply over its views and one sum, however many parameters it holds."""

    def __init__(self, params: dict[int, torch.Tensor]) -> None:
        self._params = params  # index -> parameter: the layout's shapes, devices and dtypes
        self._views: dict[int, torch.Tensor] = {}
        self._flats: list[tuple[torch.Tensor, list[int]]] = []
        self._own: dict[int, torch.Tensor] = {}  # a gradient that fits no view gets its own buffer

    def _lay_out(self) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, param in self._params.items():
            groups.setdefault((param.device, _copy_dtype(param.dtype)), []).append(index)
        for (device, dtype), indices in groups.items():
            flat = torch.empty(sum(self._params[i].numel() for i in indices), dtype=dtype, device=device)
            offset = 0
            for i in indices:
                numel = self._params[i].numel()
                self._views[i] = flat[offset : offset + numel].view(self._params[i].shape)
                offset += numel
            self._flats.append((flat, indices))

    def _place(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """This parameter's place for a tensor shaped like `like`: its view, or a buffer of its own."""
        if not self._flats:
            self._lay_out()
        view = self._views.get(index)
        if not _fits(view, like):
            view = self._own.get(index)
            if not _fits(view, like):
                view = self._own[index] = torch.empty(like.shape, dtype=_copy_dtype(like.dtype), device=like.device)
        # the ignore: _fits is False for None, so a view is always there by now
        return view  # type: ignore[return-value]

    def copy(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """`grad` copied into this parameter's place: the rank-local gradient kept apart."""
        return self._place(index, grad).copy_(grad.detach())

    def zeros(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """This parameter's place set to zero: the local gradient of a parameter this rank did
        not use (collectors/grads/unused_params.py), shaped like its gradient `like`."""
        return self._place(index, like).zero_()

    def sums(self, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(<local, reduced>, |reduced|^2) over `pairs` (index -> (local, reduced)), 0-d float64
        tensors. On an accelerator the copies this object holds are multiplied in place (they
        are spent afterwards): per flat buffer, its views that no pair uses set to zero, one
        `_foreach_mul_` and one sum, and the reduced norm one `_foreach_norm`, so the kernel
        count does not grow with the parameters. On the CPU (but with MSMON_DEVICE_PATH=1, which
        takes the accelerators' way), where a kernel launch is a function call, per parameter
        one dot product and then the reduced tensor's own, which finds it still in the cache: it
        reads both tensors once and writes nothing, which measured faster there than the
        multiply's extra write and read of the copy, and the reduced norm costs a fraction of a
        pass of its own (docs/performance.md). Any local tensor outside the flat buffers gets its
        own dot products."""
        dots: list[torch.Tensor] = []
        inside: set[int] = set()
        for flat, indices in self._flats:
            if host_code(flat.device):  # the CPU's per-parameter products (MSMON_DEVICE_PATH=1: not)
                continue
            used = [i for i in indices if i in pairs and pairs[i][0] is self._views[i]]
            if not used:
                continue
            inside.update(used)
            unused = [self._views[i] for i in indices if i not in pairs or pairs[i][0] is not self._views[i]]
            if unused:
                torch._foreach_zero_(unused)
            torch._foreach_mul_([self._views[i] for i in used], [pairs[i][1] for i in used])
            dots.append(flat.sum().double())
        squares = [_square_sum([pairs[i][1] for i in inside])] if inside else []
        rest = [(a, b) for i, (a, b) in pairs.items() if i not in inside]
        if rest:
            dot, square = _dots_and_squares(rest)
            dots.append(dot)
            squares.append(square)
        return torch.stack(dots).sum(), torch.stack(squares).sum()

    def clear(self) -> None:
        self._views.clear()
        self._flats.clear()
        self._own.clear()


def _dots_and_squares(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ <a, b>, Σ <b, b>) over `pairs`, 0-d float64s. Per pair, in the copy dtype (float32, or
    float64 for float64 copies: a 16-bit tensor is widened once for both products), the dot
    product and then b's own, while b is still in the cache; each total widened to float64 after
    (exactly) and summed there. `torch.dot` alone per product: conversions that would be no-ops
    cost as much Python as the products themselves at the reference model's 53 parameters."""
    dots: list[torch.Tensor] = []
    squares: list[torch.Tensor] = []
    for a, b in pairs:
        dtype = _copy_dtype(a.dtype)
        a, b = a.reshape(-1), b.reshape(-1)
        if a.dtype != dtype:
            a = a.to(dtype)
        if b.dtype != dtype:
            b = b.to(dtype)
        dots.append(torch.dot(a, b))
        squares.append(torch.dot(b, b))
    # stack widens a float32 product beside a float64 one exactly
    return torch.stack(dots).double().sum(), torch.stack(squares).double().sum()


def _square_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squared L2 norms of `tensors`, in float64 (each norm accumulated in
    float32, or float64 for float64 tensors: 16-bit ones are read in float32)."""
    wide = [t for t in tensors if t.dtype in (torch.float32, torch.float64)]
    narrow = [t for t in tensors if t.dtype not in (torch.float32, torch.float64)]
    parts = [torch.stack(torch._foreach_norm(wide)).double()] if wide else []
    if narrow:
        parts.append(torch.stack(torch._foreach_norm(narrow, 2, dtype=torch.float32)).double())
    return torch.cat(parts).square().sum()


def agreement(
    local: list[torch.Tensor],
    reduced: list[torch.Tensor],
    local_square: torch.Tensor | None = None,
    dot: torch.Tensor | None = None,
    reduced_square: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, norm_ratio) of the concatenations of `local` and `reduced` (pairs of one shape),
    as 0-d float64 tensors on the device; a zero gradient gives NaN. `local_square` and
    `reduced_square` (the norms squared) and `dot` are taken as given when known."""
    if dot is None or reduced_square is None:
        dot_read, square_read = _dots_and_squares(list(zip(local, reduced)))
        dot = dot_read if dot is None else dot
        reduced_square = square_read if reduced_square is None else reduced_square
    local_sq = _square_sum(local) if local_square is None else local_square
    local_norm, reduced_norm = local_sq.sqrt(), reduced_square.sqrt()
    return dot / (local_norm * reduced_norm), local_norm / reduced_norm


def of_pairs(
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
    local_norms: dict[int, torch.Tensor] | None = None,
    copies: LocalCopies | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The agreement of (local, reduced) pairs by parameter index, leaving out a missing,
    sparse or reshaped reduced gradient; None when no pair is left. `local_norms`: the local
    gradients' L2 norms already computed (0-d tensors, by index), not read again. With `copies`
    (the LocalCopies the local tensors are in), the dot product is its in-place one, which
    spends the copies."""
    kept = {
        i: (a, b) for i, (a, b) in pairs.items() if b is not None and b.layout == torch.strided and a.shape == b.shape
    }
    if not kept:
        return None
    known = local_norms or {}
    local_square = None
    if known:
        norms = [known[i] for i in kept if i in known]
        rest = [a for i, (a, _) in kept.items() if i not in known]
        local_square = torch.stack(norms).double().square().sum() if norms else None
        if rest:
            local_square = _square_sum(rest) if local_square is None else local_square + _square_sum(rest)
    local = [a for a, _ in kept.values()]
    reduced = [b for _, b in kept.values()]
    if local_square is None:
        local_square = _square_sum(local)  # before an in-place dot spends the copies
    dot, reduced_square = copies.sums(kept) if copies is not None else (None, None)
    return agreement(local, reduced, local_square, dot, reduced_square)


def add_rows(buffer, ops: list[str], cos: torch.Tensor, ratio: torch.Tensor) -> None:
    """The step's agreement rows: one value each, as wide as the step's ops (records.COLUMN_CATEGORIES)."""
    width = len(ops)
    buffer.add(RowKey(CATEGORY, NAME, 0, None, op="cos"), cos.reshape(1).expand(width))
    buffer.add(RowKey(CATEGORY, NAME, 0, None, op="norm_ratio"), ratio.reshape(1).expand(width))


def say_unavailable(rank: int, why: str) -> None:
    logger.warning("msmon[rank %d]: grad_agreement is not recorded: %s (said once)", rank, why)
