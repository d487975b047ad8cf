"""Where the accelerator path reads a batch of tensors from: flat spans cut into bounded chunks.

The multi-tensor engine (msmon.stats.multi_tensor) reduces one flat 1-D chunk at a time, each
chunk holding the pieces of several tensors back to back, so the kernels it launches grow with
the bytes read (one chunk per CHUNK elements), not with the number of tensors. A chunk is:

- a view of a storage that several tensors of the batch live in (Megatron's param-and-grad
  buffer, DeepSpeed's flat partitions, FSDP's flat parameters, DDP's gradient_as_bucket_view,
  any tensors that are dense views of one storage): ONE view of the span they cover, read in
  place, no copy; the gaps between them (padding, tensors not in the batch) are pieces of
  their own whose results are discarded; a gap wider than a quarter of what the span covers so
  far (and than GAP_MIN) starts a new span instead of being read;
- a view of one large tensor (over STAGE_MAX elements), read in place, cut into chunks: its
  pieces are combined exactly afterwards (norms in squares, min of mins, sums of counts);
- a copy of small separate tensors (each at most STAGE_MAX elements; plain torch.optim's
  parameters, gradients and moments) into a reused staging buffer, one `torch.cat(..., out=)`
  per chunk. This is the one copy on the path, the trade that keeps launches flat: a kernel
  launch costs 5-20 µs of host time, while copying STAGE_MAX = 1 M float32 elements (4 MiB read,
  4 MiB written) takes a few µs of HBM bandwidth; a tensor read in place would take its own
  dozen launches. Tensors above STAGE_MAX amortise their own launches over at least 4 MiB each.

A tensor is viewed flat when it is dense (its elements fill exactly `numel` consecutive storage
slots, in any dimension order: a transposed weight is; every statistic ignores element order).
A tensor that is not (a strided slice, an expanded tensor whose elements repeat) is copied once
with `reshape(-1)`, as the host path's reductions would read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CHUNK = 1 << 22  # elements per reduced chunk: 16 MiB of float32; bounds every temporary
STAGE_MAX = 1 << 20  # tensors up to this many elements are copied into a staging chunk
GAP_MIN = 1 << 16  # gaps up to this many elements are always read through
GAP = -1  # the row of a piece that belongs to no tensor of the batch


@dataclass
class Chunk:
    """One flat chunk: `view` (a span's view) or `staged` (tensors to copy, in order), and its
    pieces as (row, length) in order; row GAP for a gap. Lengths sum to the chunk's size."""

    pieces: list[tuple[int, int]] = field(default_factory=list)
    view: torch.Tensor | None = None
    staged: list[torch.Tensor] = field(default_factory=list)
    size: int = 0  # elements: the pieces' lengths summed, kept as pieces are added (add)

    def add(self, row: int, length: int) -> None:
        """One more piece at the end."""
        self.pieces.append((row, length))
        self.size += length


def dense_flat(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s elements as a 1-D view of its storage when it is dense (in any dimension order),
    else None. The order of the elements may differ from t.view(-1)'s; no statistic sees it."""
    if t.is_contiguous():
        return t.view(-1)
    expected = 1
    for size, stride in sorted((s, st) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _runs(members: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """(offset, numel, row) of the tensors of one storage, sorted, split into runs read as one
    span: no overlap (a tensor overlapping the run goes on alone) and no gap wider than
    max(GAP_MIN, a quarter of what the run covers so far)."""
    runs: list[list[tuple[int, int, int]]] = []
    alone: list[tuple[int, int, int]] = []
    for member in sorted(members):
        offset, numel, _ = member
        if runs:
            run = runs[-1]
            end = run[-1][0] + run[-1][1]
            covered = sum(m[1] for m in run)
            if offset < end:  # overlaps a tensor of the run: read on its own
                alone.append(member)
                continue
            if offset - end <= max(GAP_MIN, covered // 4):
                run.append(member)
                continue
        runs.append([member])
    return runs + [[m] for m in alone]


def _span_chunks(base: torch.Tensor, run: list[tuple[int, int, int]]) -> list[Chunk]:
    """The chunks of one span of a storage: one view of it, cut every CHUNK elements."""
    start = run[0][0]
    span = base.as_strided((run[-1][0] + run[-1][1] - start,), (1,), start)
    segments: list[tuple[int, int]] = []
    position = start
    for offset, numel, row in run:
        if offset > position:
            segments.append((GAP, offset - position))
        segments.append((row, numel))
        position = offset + numel
    chunks: list[Chunk] = []
    begin = 0
    current = Chunk()
    for row, length in segments:
        while length:
            take = min(length, CHUNK - current.size)
            current.add(row, take)
            length -= take
            if current.size == CHUNK:
                current.view = span[begin : begin + CHUNK]
                chunks.append(current)
                begin += CHUNK
                current = Chunk()
    if current.pieces:
        current.view = span[begin:]
        chunks.append(current)
    return [c for c in chunks if any(row != GAP for row, _ in c.pieces)]


def chunks_of(ts: list[torch.Tensor]) -> list[Chunk]:
    """The chunks that cover every tensor of a batch (one device and dtype, none empty) once.
    Each tensor's pieces are consecutive in chunk order."""
    flats: list[torch.Tensor] = []
    by_storage: dict[int, list[tuple[int, int, int]]] = {}
    for row, t in enumerate(ts):
        flat = dense_flat(t)
        if flat is None:
            flat = t.reshape(-1)  # a copy: the elements are not one dense block of the storage
        flats.append(flat)
        by_storage.setdefault(flat.untyped_storage().data_ptr(), []).append(
            (int(flat.storage_offset()), t.numel(), row)
        )
    chunks: list[Chunk] = []
    small: list[int] = []
    for members in by_storage.values():
        for run in _runs(members):
            if len(run) == 1 and run[0][1] <= STAGE_MAX:
                small.append(run[0][2])
            else:
                chunks.extend(_span_chunks(flats[run[0][2]], run))
    staged = Chunk()
    for row in sorted(small):
        numel = flats[row].numel()
        if staged.size + numel > CHUNK:
            chunks.append(staged)
            staged = Chunk()
        staged.add(row, numel)
        staged.staged.append(flats[row])
    if staged.pieces:
        chunks.append(staged)
    return chunks
