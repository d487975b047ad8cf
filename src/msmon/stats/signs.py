"""mg_direction: how many elements of a gradient point the way of its momentum."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import cast

import torch

from .device_path import host_code
from .inputs import RESULT_DTYPE, _as_stat_input, _to_device
from .reductions import _MIN_SEGMENTS, CHUNK, SMALL, _layout
from .threads import _cpu_threads

_SIGN_CHUNK = 1 << 22  # elements per pass on accelerators: bounds the temporaries (16 MiB of float32 each)


def _sign_mismatch(g: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count of elements with sign(g) != sign(m), whether either holds a NaN) of two flat
    tensors of one size, as 0-d tensors; one temporary pair per chunk. torch.sign(NaN) is 0,
    so NaNs are looked for apart, in the maxima."""
    chunk = CHUNK if host_code(g.device) else _SIGN_CHUNK
    counts, nans = [], []
    for start in range(0, g.numel(), chunk):
        gc, mc = g[start : start + chunk], m[start : start + chunk]
        d = torch.sign(gc)
        d.sub_(torch.sign(mc)).abs_().clamp_(max=1)  # 1 where the signs differ (count_nonzero: 4x slower)
        counts.append(d.sum(dtype=torch.float32))  # exact: a chunk holds fewer than 2**24 elements
        nans.append(torch.amax(gc))  # max propagates NaN (and only NaN): a cheap reduction, not isnan().any()
        nans.append(torch.amax(mc))
    return torch.stack(counts).sum().to(RESULT_DTYPE), torch.isnan(torch.stack(nans)).any()


def _matches(numel: int, mismatch: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    return torch.where(nan, math.nan, numel - mismatch)


def sign_matches(grads: Sequence[torch.Tensor], moments: Sequence[torch.Tensor]) -> torch.Tensor:
    """[n] float64 counts of the elements where sign(grad) == sign(moment) (zero equals zero),
    pair by pair, on the first gradient's device without host sync. A pair holding a NaN, or
    of unequal sizes, counts NaN. Small pairs of one device and dtype are compared in one pass over a flat copy
    (as batch_stats does), larger ones tensor by tensor in bounded chunks."""
    if not grads:
        return torch.empty(0, dtype=RESULT_DTYPE)
    pairs = [(_as_stat_input(g).reshape(-1), _as_stat_input(m).reshape(-1)) for g, m in zip(grads, moments)]
    device = pairs[0][0].device
    out: list[torch.Tensor | None] = [None] * len(pairs)
    small: dict[tuple, list[int]] = defaultdict(list)
    for i, (g, m) in enumerate(pairs):
        if g.numel() != m.numel() or g.device != m.device:
            out[i] = torch.tensor(math.nan, dtype=RESULT_DTYPE, device=device)
        elif g.numel() == 0:
            out[i] = torch.zeros((), dtype=RESULT_DTYPE, device=device)
        elif g.numel() <= SMALL:
            small[(g.device, g.dtype, m.dtype)].append(i)
        else:
            out[i] = _matches(g.numel(), *_sign_mismatch(g, m)).to(device)
    with _cpu_threads(device):
        for (dev, _, _), indices in small.items():
            if len(indices) < _MIN_SEGMENTS:
                for i in indices:
                    out[i] = _matches(pairs[i][0].numel(), *_sign_mismatch(*pairs[i])).to(device)
                continue
            flat_g = torch.cat([pairs[i][0] for i in indices])
            flat_m = torch.cat([pairs[i][1] for i in indices])
            numels = tuple(pairs[i][0].numel() for i in indices)
            lengths, _ = _layout(numels, dev)
            d = torch.sign(flat_g)
            d.sub_(torch.sign(flat_m)).abs_().clamp_(max=1)
            mismatch = torch.segment_reduce(d.to(torch.float32), "sum", lengths=lengths)
            nans = torch.isnan(torch.segment_reduce(flat_g.to(torch.float32), "max", lengths=lengths)) | torch.isnan(
                torch.segment_reduce(flat_m.to(torch.float32), "max", lengths=lengths)
            )
            sizes = _to_device(torch.tensor(numels, dtype=RESULT_DTYPE), dev)
            counts = torch.where(nans, math.nan, sizes - mismatch.to(RESULT_DTYPE)).to(device)
            for j, i in enumerate(indices):
                out[i] = counts[j]
    return torch.stack([cast(torch.Tensor, t).to(device) for t in out])  # every entry is set above
