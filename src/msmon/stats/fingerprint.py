"""Bit-exact fingerprints of tensors, computed on their device without a host sync.

Used by the replica check (collectors/replica_check.py): two data-parallel replicas of a
weight are taken to agree when their fingerprints agree. A single flipped bit always changes the fingerprint; a norm or a sum of
the values would not (a flipped low mantissa bit can round away, +x and -x swap unseen).

The formula
-----------
1. Words. A tensor's bytes are read as a flat vector x_0..x_{n-1} of signed 32-bit words:
   - 4-byte elements (float32, int32): one word each (`t.view(torch.int32)`);
   - 8-byte elements (float64, int64; complex as its real pairs): two words each, low half first;
   - 2-byte elements (bfloat16, float16, int16): elements 2k and 2k+1 form one word (2k in the low
     half, as `view(torch.int32)` reads them on a little-endian machine); an odd last element is
     a word of its own, sign-extended from 16 bits;
   - 1-byte elements (int8, uint8, bool, float8): one word each, sign-extended from 8 bits.
2. Rows. Word i sits in row r = i // C at column c = i % C, with C = 4096.
3. Sums, all modulo 2^64 (int64 arithmetic), with fixed odd 64-bit weights W_c and V_r taken
   from splitmix64 of c and of r:

       S_r = sum over c of  x_{rC+c} * W_c        (x sign-extended to 64 bits)
       F   = sum over r of  V_r * S_r

Why one flipped bit always changes F: flipping bit b (0 <= b <= 31) of word x_i changes its
sign-extended value by d = +-2^b. Then F changes by V_r * W_c * d modulo 2^64. V_r * W_c is
odd, and an odd number times 2^b with b < 64 is never a multiple of 2^64, so the change is
never 0. Every bit of every element lies in exactly one word, so this covers every bit
position of every dtype above, wherever the element sits. The weights differ from position to
position in all their low 33 bits, so two swapped elements, or two flips that would cancel in
a plain sum, are caught as well (not guaranteed: two flips of the same bit b cancel only when
W_c * V_r of their positions agree, up to sign, modulo 2^(64-b): about 2^-32 for bit 31).

Cost: tensors of at most C words are batched (one concatenation per device, one cumulative
sum, one gather of segment ends); a larger tensor is multiplied row-block by row-block into a
reused int64 scratch buffer and reduced (four kernels per 2M words). Nothing waits for the
device: the result is an int64 tensor on the tensors' device.

int64 arithmetic in torch wraps modulo 2^64 on the CPU and on CUDA (two's complement); the
tests check the whole computation against Python's integers.
"""  # noqa: E501

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

COLUMNS = 4096  # C: words per row; tensors of at most this many words are batched
BLOCK_WORDS = 1 << 21  # words multiplied per kernel for a large tensor (16 MiB of int64 scratch)
_W_SEED = 0x5EED_0F_C01
_V_SEED = 0xA11CE_0F_2057


_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 of each int64 taken as 64 bits (int64 arithmetic wraps modulo 2^64; the
    right shifts are made logical by masking off the copied sign bits)."""
    z = z + _signed64(0x9E3779B97F4A7C15)
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed64(0xBF58476D1CE4E5B9)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed64(0x94D049BB133111EB)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def column_weights(count: int = COLUMNS) -> torch.Tensor:
    """W_0..W_{count-1}: odd 64-bit weights, splitmix64(c + seed) with the low bit set."""
    return _splitmix64(torch.arange(count, dtype=torch.int64) + _W_SEED) | 1


def row_weights(count: int) -> torch.Tensor:
    """V_0..V_{count-1}: odd 64-bit weights, splitmix64(r xor seed) with the low bit set."""
    return _splitmix64(torch.arange(count, dtype=torch.int64) ^ _V_SEED) | 1


def words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int32 vector, as the module docstring defines them: a view
    of the tensor where its layout allows, else a copy (odd-length or oddly placed 16-bit
    tensors, 8-bit tensors, non-contiguous tensors)."""
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    size = flat.element_size()
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.int32, device=flat.device)
    if size % 4 == 0:
        return flat.view(torch.int32)
    if size == 2:
        half = flat.view(torch.int16)
        n = half.numel()
        if n % 2 == 0 and half.storage_offset() % 2 == 0:
            return half.view(torch.int32)
        wide = half.to(torch.int64) & 0xFFFF
        even = n - n % 2
        pairs = (wide[0:even:2] | (wide[1:even:2] << 16)).to(torch.int32)  # the bits view() would give
        if n % 2 == 0:
            return pairs
        return torch.cat([pairs, half[-1:].to(torch.int32)])
    if size == 1:
        return flat.view(torch.int8).to(torch.int32)
    raise TypeError(f"msmon: cannot fingerprint a tensor of {flat.dtype} ({size}-byte elements)")


class Fingerprinter:
    """Computes F for lists of tensors; keeps the weight tables and scratch per device and the
    batching plan of the last layout (the replica check fingerprints the same list each time)."""

    def __init__(self, columns: int = COLUMNS, block_words: int = BLOCK_WORDS) -> None:
        self.columns = columns
        self.block_rows = max(1, block_words // columns)
        self._w: dict[torch.device, torch.Tensor] = {}
        self._v: dict[torch.device, torch.Tensor] = {}
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self._plans: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._index: dict[tuple, torch.Tensor] = {}

    # -- tables ---------------------------------------------------------------------------------
    def _col(self, device: torch.device) -> torch.Tensor:
        w = self._w.get(device)
        if w is None:
            w = self._w[device] = column_weights(self.columns).to(device)
        return w

    def _row(self, device: torch.device, count: int) -> torch.Tensor:
        v = self._v.get(device)
        if v is None or v.numel() < count:
            size = 1 << max(count - 1, 1).bit_length()
            v = self._v[device] = row_weights(size).to(device)
        return v

    def _scratch_for(self, device: torch.device, count: int) -> torch.Tensor:
        s = self._scratch.get(device)
        if s is None or s.numel() < count:
            s = self._scratch[device] = torch.empty(count, dtype=torch.int64, device=device)
        return s[:count]

    # -- fingerprints ---------------------------------------------------------------------------
    def __call__(self, tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        """int64 [len(tensors)]: F of each tensor, on `device` (default: the first tensor's)."""
        if device is None:
            device = tensors[0].device if tensors else torch.device("cpu")
        with torch.no_grad():
            flat = [words(t) for t in tensors]
            out = torch.zeros(len(flat), dtype=torch.int64, device=device)
            by_device: dict[torch.device, tuple[list[int], list[int]]] = {}
            for i, w in enumerate(flat):
                small, large = by_device.setdefault(w.device, ([], []))
                (small if w.numel() <= self.columns else large).append(i)
            for dev, (small, large) in by_device.items():
                if small:
                    values = self._small(dev, [flat[i] for i in small])
                    out.index_copy_(0, self.positions(device, small), values.to(device))
                if large:
                    values = torch.stack([self._large(dev, flat[i]) for i in large])
                    out.index_copy_(0, self.positions(device, large), values.to(device))
        return out

    def positions(self, device: torch.device, indices: list[int]) -> torch.Tensor:
        """`indices` as an int64 tensor on `device`, made once per layout: a tensor built from a
        list on an accelerator would be a blocking host-to-device copy at every call."""
        key = (device, tuple(indices))
        found = self._index.get(key)
        if found is None:
            if len(self._index) > 32:
                self._index.pop(next(iter(self._index)))
            found = self._index[key] = torch.tensor(indices, dtype=torch.int64).to(device)
        return found

    def _small(self, device: torch.device, parts: list[torch.Tensor]) -> torch.Tensor:
        """F of tensors of at most C words (row 0 only): one concatenation, one cumulative sum."""
        sizes = tuple(p.numel() for p in parts)
        key = (device, sizes)
        plan = self._plans.get(key)
        if plan is None:
            col = self._col(device)
            weights = torch.cat([col[:n] for n in sizes]) if sum(sizes) else col[:0]
            ends = torch.tensor(list(itertools.accumulate((0,) + sizes)), dtype=torch.int64).to(device)
            plan = self._plans[key] = (weights, ends)
            if len(self._plans) > 8:  # layouts change rarely; keep a few
                self._plans.pop(next(iter(self._plans)))
        weights, ends = plan
        total = int(sum(sizes))
        if total == 0:
            return torch.zeros(len(parts), dtype=torch.int64, device=device)
        products = torch.cat(parts).to(torch.int64).mul_(weights)
        sums = torch.zeros(total + 1, dtype=torch.int64, device=device)
        torch.cumsum(products, 0, out=sums[1:])  # wraps modulo 2^64; differences stay exact
        return sums.index_select(0, ends).diff() * self._row(device, 1)[0]

    def _large(self, device: torch.device, x: torch.Tensor) -> torch.Tensor:
        """F of one tensor, row block by row block."""
        c = self.columns
        n = x.numel()
        rows = n // c
        col = self._col(device)
        v = self._row(device, rows + 1)
        parts = []
        for start in range(0, rows, self.block_rows):
            count = min(self.block_rows, rows - start)
            block = x[start * c : (start + count) * c].view(count, c)
            scratch = self._scratch_for(device, count * c).view(count, c)
            scratch.copy_(block)  # widen first: an int64 x int64 multiply is twice as fast as a mixed one
            parts.append(scratch.mul_(col).sum(1).mul_(v[start : start + count]).sum())
        tail = n - rows * c
        if tail:
            parts.append((x[rows * c :] * col[:tail]).sum() * v[rows])
        return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def fingerprint(t: torch.Tensor) -> int:
    """F of one tensor as a Python int (reads it back to the host: for tests and tools)."""
    return int(Fingerprinter()([t]).item())
