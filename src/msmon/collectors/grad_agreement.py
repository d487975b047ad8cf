"""Gradient agreement (`grad_agreement`): how far a rank's own gradient points where the
data-parallel average does.

Per rank and step, over every monitored parameter the data-parallel reduction averages:
    cos        = <local, reduced> / (|local| |reduced|)
    norm_ratio = |local| / |reduced|
`local` is the rank-local gradient of the step (grad_unreduced's tensor), `reduced` the whole
average the reduction leaves on this rank. Ranks fed similar data have cos near 1 and a ratio
near 1 (more when their batches are noisy: the average cancels noise); a rank whose data
departs has its cos drop. No collective is added: both tensors are on this rank.

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
of the same tensor where one was computed in the same pass; the dot product, one in-place
`_foreach_mul_` of the copy (spent afterwards) and one sum per flat buffer (per-parameter dots
on the CPU); and the reduced norm, taken from the `norm` column of the same step's grad_reduced
rows, read from the very `.grad` the reduction left (`Partial`, `ReducedNorm`: where something
rewrites `.grad` before the optimizer step, or `norm` is not an op, one `_foreach_norm` at the
reduction instead). A few kernels, whatever the parameter count; on the CPU the copy and the dot
product are what is left (docs/performance.md).

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

from ..output.records import RowKey
from .grad_tensors import identity

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


# the in-place multiply also on the CPU (tests run the accelerators' path with it)
IN_PLACE_ON_CPU = False


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

    def copy(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """`grad` copied into this parameter's place: the rank-local gradient kept apart."""
        if not self._flats:
            self._lay_out()
        view = self._views.get(index)
        if not _fits(view, grad):
            view = self._own.get(index)
            if not _fits(view, grad):
                view = self._own[index] = torch.empty(grad.shape, dtype=_copy_dtype(grad.dtype), device=grad.device)
        # the ignore: _fits is False for None, so a view is always there by now
        return view.copy_(grad.detach())  # type: ignore[union-attr]

    def dot(self, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """<local, reduced> over `pairs` (index -> (local, reduced)), a 0-d float64 tensor. On an
        accelerator the copies this object holds are multiplied in place (they are spent
        afterwards): per flat buffer, its views that no pair uses set to zero, one
        `_foreach_mul_` and one sum, so the kernel count does not grow with the parameters. On
        the CPU, where a kernel launch is a function call, one dot product per parameter: it
        reads both tensors once and writes nothing, which measured faster there than the
        multiply's extra write and read of the copy (docs/performance.md). Any local tensor
        outside the flat buffers gets its own dot product."""
        sums: list[torch.Tensor] = []
        inside: set[int] = set()
        for flat, indices in self._flats:
            if flat.device.type == "cpu" and not IN_PLACE_ON_CPU:
                continue
            used = [i for i in indices if i in pairs and pairs[i][0] is self._views[i]]
            if not used:
                continue
            inside.update(used)
            unused = [self._views[i] for i in indices if i not in pairs or pairs[i][0] is not self._views[i]]
            if unused:
                torch._foreach_zero_(unused)
            torch._foreach_mul_([self._views[i] for i in used], [pairs[i][1] for i in used])
            sums.append(flat.sum().double())
        rest = [(a, b) for i, (a, b) in pairs.items() if i not in inside]
        if rest:
            sums.append(_dots(rest))
        return torch.stack(sums).sum()

    def clear(self) -> None:
        self._views.clear()
        self._flats.clear()
        self._own.clear()


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dtype = _copy_dtype(a.dtype)
    return torch.dot(a.reshape(-1).to(dtype), b.reshape(-1).to(dtype)).double()


def _dots(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Σ <a, b> over `pairs`, a 0-d float64: one dot product per pair, totalled in float64. A pair
    already of one dtype (a copy and a float32 or float64 gradient: the usual case) takes
    `torch.dot` alone, its results widened together afterwards, which is exact: a third of the
    calls per parameter of `_dot`, whose conversions are no-ops there (0.4 against 0.2 ms of
    Python per step for the reference model's 53 parameters)."""
    dots = [torch.dot(a.reshape(-1), b.reshape(-1)) if a.dtype == b.dtype else _dot(a, b) for a, b in pairs]
    return torch.stack(dots).double().sum()  # stack widens a float32 dot beside a float64 one exactly


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
    if dot is None:
        dot = _dots(list(zip(local, reduced)))
    local_sq = _square_sum(local) if local_square is None else local_square
    reduced_sq = _square_sum(reduced) if reduced_square is None else reduced_square
    local_norm, reduced_norm = local_sq.sqrt(), reduced_sq.sqrt()
    return dot / (local_norm * reduced_norm), local_norm / reduced_norm


class Partial:
    """An agreement computed at the reduction but for the reduced gradients' norm, which the
    same step's grad_reduced rows usually hold already (their `norm` column, read from the very
    `.grad` at step time): finished there, it costs no pass of its own over the reduced
    gradients. Where a row describes another tensor or is missing, the reduced gradient kept
    here is read then, if it is still as the reduction left it (its identity: object, data
    pointer, version counter); one rewritten since (clipped or unscaled in place) has lost the
    value the cosine needs, and `finish` answers None. With `reduced_square` given, the norm
    was read at the reduction and `finish` only divides."""

    def __init__(
        self,
        local_square: torch.Tensor,
        dot: torch.Tensor,
        reduced: dict[int, torch.Tensor],
        reduced_square: torch.Tensor | None = None,
    ) -> None:
        self.local_square = local_square
        self.dot = dot
        self.reduced_square = reduced_square
        self._reduced = reduced
        self._identities = {i: identity(t) for i, t in reduced.items()}

    def unchanged(self) -> bool:
        """Whether every reduced gradient is still as the reduction left it: where that holds
        when a step's rows are taken, the norm can wait for them."""
        return all(identity(t) == self._identities[i] for i, t in self._reduced.items())

    def finish(
        self, described: dict[int, tuple[torch.Tensor, int]], norms: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, norm_ratio), or None when a reduced gradient's norm is lost. `norms`: the L2
        norms of this step's grad_reduced rows (their `norm` column; None without that op);
        `described`: index -> (the gradient a row was read from, its position in `norms`). A row
        counts only where it was read from the very tensor, unmodified, the reduction left."""
        reduced_sq = self.reduced_square
        if reduced_sq is None:
            at: dict[int, int] = {}
            if norms is not None:
                at = {
                    i: described[i][1]
                    for i in self._reduced
                    if i in described and identity(described[i][0]) == self._identities[i]
                }
            rest = {i: t for i, t in self._reduced.items() if i not in at}
            if any(identity(t) != self._identities[i] for i, t in rest.items()):
                return None
            parts = []
            if norms is not None and at:
                whole = len(at) == len(norms) and list(at.values()) == list(range(len(norms)))
                column = norms if whole else torch.stack([norms[p] for p in at.values()])
                parts.append(column.double().square().sum())
            if rest:
                parts.append(_square_sum(list(rest.values())))
            reduced_sq = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        return agreement([], [], self.local_square, self.dot, reduced_sq)


class ReducedNorm:
    """Where a monitor's agreement takes the reduced gradients' norm. The first step reads it at
    the reduction and checks, when the step's rows are taken, whether the reduced gradients are
    still as the reduction left them; where they are, later steps leave the norm to the rows
    (`Partial.finish`). A step whose reduced gradients were rewritten in between after all
    (clipped or unscaled in place on that step only) gets no agreement row, said once, and the
    norm is read at the reduction from then on. Without the `norm` op it is always read there."""

    def __init__(self) -> None:
        self._later: bool | None = None  # None: not known yet

    def later(self, ops: list[str]) -> bool:
        return self._later is True and "norm" in ops

    def finish(
        self,
        partial: Partial,
        described: dict[int, tuple[torch.Tensor, int]],
        norms: torch.Tensor | None,
        where: tuple[int, int],
        learn: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`partial` finished with the step's grad_reduced rows (Partial.finish's arguments);
        `where`: (rank, step), for the log; `learn`: whether this partial's gradients tell about the
        next steps' (not a framework's reduction, whose agreement always reads the norm there)."""
        agreed = partial.finish(described, norms)
        if not learn:
            return agreed
        if self._later is None and partial.reduced_square is not None:
            self._later = partial.unchanged()
        if agreed is None:
            self._later = False
            logger.warning(
                "msmon[rank %d]: the reduced gradients were rewritten between the end of backward and the "
                "optimizer step of step %d (clipped or unscaled in place?) after earlier steps left them as "
                "the reduction did: that step has no grad_agreement row, and their norm is read at the "
                "reduction from now on (said once)",
                *where,
            )
        return agreed


def of_pairs(
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
    local_norms: dict[int, torch.Tensor] | None = None,
    copies: LocalCopies | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, norm_ratio) of (local, reduced) pairs by parameter index (partial_of_pairs, its
    reduced norm read now)."""
    partial = partial_of_pairs(pairs, local_norms, copies)
    return None if partial is None else partial.finish({}, None)


def partial_of_pairs(
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
    local_norms: dict[int, torch.Tensor] | None = None,
    copies: LocalCopies | None = None,
    norm_later: bool = False,
) -> Partial | None:
    """The agreement of (local, reduced) pairs by parameter index, leaving out a missing,
    sparse or reshaped reduced gradient; None when no pair is left. `local_norms`: the local
    gradients' L2 norms already computed (0-d tensors, by index), not read again. With `copies`
    (the LocalCopies the local tensors are in), the dot product is its in-place one, which
    spends the copies. The reduced norm is read now, or with `norm_later` left to
    `Partial.finish` (the step's grad_reduced rows)."""
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
    if local_square is None:
        local_square = _square_sum([a for a, _ in kept.values()])  # before an in-place dot spends the copies
    if copies is not None:
        dot = copies.dot(kept)
    else:
        dot = _dots(list(kept.values()))
    reduced = {i: b for i, (_, b) in kept.items()}
    return Partial(local_square, dot, reduced, None if norm_later else _square_sum(list(reduced.values())))


def add_rows(buffer, ops: list[str], cos: torch.Tensor, ratio: torch.Tensor) -> None:
    """The step's agreement rows: one value each, as wide as the step's ops (records.COLUMN_CATEGORIES)."""
    width = len(ops)
    buffer.add(RowKey(CATEGORY, NAME, 0, None, op="cos"), cos.reshape(1).expand(width))
    buffer.add(RowKey(CATEGORY, NAME, 0, None, op="norm_ratio"), ratio.reshape(1).expand(width))


def say_unavailable(rank: int, why: str) -> None:
    logger.warning("msmon[rank %d]: grad_agreement is not recorded: %s (said once)", rank, why)
