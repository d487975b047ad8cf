"""How one flat chunk is cut into the [rows, BLOCK] rows of the compiled pass (msmon.stats.fused_rows).

A chunk (msmon.stats.flat_layout) holds pieces of several tensors back to back. Viewed as
blocks of BLOCK elements, most blocks lie inside one piece: they are the rows of the chunk's
own [blocks, BLOCK] view, read in place. A block where pieces meet (a tensor's first or last
elements, or a small tensor whole) is copied once per piece it holds into a small boundary
matrix, each copy with that piece's columns [lo, hi): at most two blocks per piece, so the copy
is bounded by 2 * BLOCK elements per tensor whatever the tensors' sizes. The chunk's last,
partial block is read in place when the storage goes on past the chunk (the columns past its
end are outside every row's [lo, hi)), and otherwise copied zero-padded.

Everything here is host arithmetic on the layout, cached per layout: a repeated step builds
nothing and copies no index to the device again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .flat_layout import GAP
from .fused_rows import BLOCK

SKIP = -1  # the tensor of a row whose values are dropped (a block where pieces meet, a gap)


@dataclass(frozen=True, eq=False)  # one object per layout (block_rows is cached): equal by identity,
class BlockRows:  # so that a key made of them hashes in O(1), not over thousands of rows
    """One chunk's rows: the chunk's block view, each row read whole (`main_tensors`: none when the
    view has fewer than two rows, which are then boundary rows), and the boundary matrix, whose
    rows are copies of blocks `boundary_blocks` (block `blocks` is the zero-padded tail), each
    read over its columns [lo, hi)."""

    blocks: int  # whole blocks of the chunk
    view_rows: int  # rows of the in-place view: blocks, and the tail block when it is read in place
    main_rows: int  # view_rows, or 0 when that is under two (the view is then only gathered from)
    main_tensors: tuple[int, ...]  # per view row: the tensor the whole block belongs to, or SKIP
    boundary_blocks: tuple[int, ...]
    boundary_lo: tuple[int, ...]
    boundary_hi: tuple[int, ...]
    boundary_tensors: tuple[int, ...]

    @property
    def tensors(self) -> tuple[int, ...]:
        """The tensor of every row, main rows first, in the order the values are stacked."""
        return self.main_tensors + self.boundary_tensors


def _segments(pieces: tuple[tuple[int, int], ...]) -> tuple[dict[int, int], list[tuple[int, int, int, int]]]:
    """Blocks wholly inside one tensor's piece ({block: tensor}), and the parts of blocks where
    pieces meet as (block, lo, hi, tensor); gaps left out."""
    whole: dict[int, int] = {}
    parts: list[tuple[int, int, int, int]] = []
    start = 0
    for row, length in pieces:
        end = start + length
        if row != GAP:
            block = start // BLOCK
            while block * BLOCK < end:
                lo = max(start - block * BLOCK, 0)
                hi = min(end - block * BLOCK, BLOCK)
                if lo == 0 and hi == BLOCK:
                    whole[block] = row
                else:
                    parts.append((block, lo, hi, row))
                block += 1
        start = end
    return whole, parts


@functools.lru_cache(maxsize=512)
def block_rows(pieces: tuple[tuple[int, int], ...], size: int, tail_in_place: bool) -> BlockRows:
    """The rows of a chunk of `size` elements made of `pieces` ((tensor, length), GAP for a gap).
    `tail_in_place`: the storage goes on past the chunk, so its partial last block is a row of
    the in-place view."""
    blocks = size // BLOCK
    has_tail = size % BLOCK != 0
    view_rows = main_rows = blocks + (1 if has_tail and tail_in_place else 0)
    whole, parts = _segments(pieces)
    if main_rows < 2:  # one row would specialise the compiled code: every row is a copy
        parts = [(block, 0, BLOCK, row) for block, row in sorted(whole.items())] + parts
        whole = {}
        main_rows = 0
    in_view = [(block, lo, hi, row) for block, lo, hi, row in parts if block < view_rows]
    copied = [(block, lo, hi, row) for block, lo, hi, row in parts if block >= view_rows]  # the padded tail
    boundary = in_view + copied
    if len(boundary) == 1:  # two rows at least (see above): a second row that counts nothing
        boundary.append((boundary[0][0], 0, 0, SKIP))
    main_tensors = tuple(whole.get(block, SKIP) for block in range(main_rows))
    return BlockRows(blocks, view_rows, main_rows, main_tensors, *_columns(boundary))


def _columns(
    rows: list[tuple[int, int, int, int]],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    if not rows:
        return (), (), (), ()
    blocks, lo, hi, tensors = zip(*rows)
    return tuple(blocks), tuple(lo), tuple(hi), tuple(tensors)
