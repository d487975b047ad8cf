"""The replica check's fingerprint: equal to an independent Python-integer computation of the
documented formula, and changed by every single flipped bit of every element."""

from __future__ import annotations

import struct

import pytest
import torch

from msmon.stats.fingerprint import COLUMNS, Fingerprinter, column_weights, fingerprint, row_weights, words

M64 = (1 << 64) - 1


def py_splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def signed(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def py_words(t: torch.Tensor) -> list[int]:
    """The words of the module docstring, from the tensor's bytes, with Python integers."""
    t = t.detach().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t).contiguous()
    size = t.element_size()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    if size in (4, 8):
        return [signed(v, 32) for (v,) in struct.iter_unpack("<I", raw)]
    if size == 2:
        halves = [v for (v,) in struct.iter_unpack("<H", raw)]
        out = [signed(halves[k] | (halves[k + 1] << 16), 32) for k in range(0, len(halves) - 1, 2)]
        if len(halves) % 2:
            out.append(signed(halves[-1], 16))
        return out
    return [signed(b, 8) for b in raw]


def py_fingerprint(t: torch.Tensor, columns: int = COLUMNS) -> int:
    x = py_words(t)
    w = [signed(py_splitmix64((c + 0x5EED_0F_C01) & M64) | 1, 64) for c in range(columns)]
    rows = (len(x) + columns - 1) // columns
    total = 0
    for r in range(rows):
        s = sum(x[i] * w[i - r * columns] for i in range(r * columns, min(len(x), (r + 1) * columns)))
        v = signed(py_splitmix64(r ^ 0xA11CE_0F_2057) | 1, 64)
        total += v * s
    return signed(total, 64)


def test_the_weight_tables_are_odd_and_are_splitmix64():
    w, v = column_weights(COLUMNS).tolist(), row_weights(5000).tolist()
    assert w == [signed(py_splitmix64(c + 0x5EED_0F_C01) | 1, 64) for c in range(COLUMNS)]
    assert v == [signed(py_splitmix64(r ^ 0xA11CE_0F_2057) | 1, 64) for r in range(5000)]
    assert all(x % 2 for x in w + v)


CASES = {
    "float32 small": lambda: torch.randn(7, 5),
    "float32 several rows and a tail": lambda: torch.randn(3 * COLUMNS + 123),
    "float32 whole rows": lambda: torch.randn(2 * COLUMNS),
    "bfloat16 odd length": lambda: torch.randn(2 * COLUMNS * 2 + 3).to(torch.bfloat16),
    "float16 even": lambda: torch.randn(64, 33).half(),
    "float16 one element": lambda: torch.randn(1).half(),
    "bfloat16 at an odd offset": lambda: torch.randn(2 * COLUMNS + 10).to(torch.bfloat16)[1:],
    "float64": lambda: torch.randn(COLUMNS + 1, dtype=torch.float64),
    "int64 extremes": lambda: torch.tensor([2**63 - 1, -(2**63), 0, -1] * 700, dtype=torch.int64),
    "int32 extremes": lambda: torch.tensor([2**31 - 1, -(2**31), 1] * 3000, dtype=torch.int32),
    "uint8": lambda: torch.randint(0, 256, (101,), dtype=torch.uint8),
    "bool": lambda: torch.rand(37) > 0.5,
    "complex64": lambda: torch.randn(9, dtype=torch.complex64),
    "non-contiguous": lambda: torch.randn(70, 80).t(),
    "empty": lambda: torch.empty(0, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_fingerprint_is_the_documented_formula(name):
    torch.manual_seed(0)
    t = CASES[name]()
    assert fingerprint(t) == py_fingerprint(t)


def test_words_of_a_16_bit_tensor_are_the_same_whether_viewed_or_copied():
    t = torch.randn(2 * COLUMNS + 11).to(torch.bfloat16)
    shifted = torch.cat([t[:1], t])[1:]  # same values at an odd storage offset: the copy path
    assert shifted.storage_offset() == 1
    assert torch.equal(words(t[:-1]), words(shifted[:-1]))


def test_one_batched_call_equals_one_call_per_tensor_whatever_the_block_size():
    torch.manual_seed(1)
    tensors = [
        torch.randn(5),
        torch.randn(3 * COLUMNS + 7).to(torch.bfloat16),
        torch.empty(0),
        torch.randn(33, 17),
        torch.randn(COLUMNS).half(),
        torch.randn(9 * COLUMNS + 1, dtype=torch.float64),
    ]
    alone = [py_fingerprint(t) for t in tensors]
    for block_words in (COLUMNS, 2 * COLUMNS, 1 << 22):
        fp = Fingerprinter(block_words=block_words)
        assert fp(tensors).tolist() == alone
        assert fp(tensors).tolist() == alone  # the cached plan gives the same


def flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of t with one bit of one element flipped (through an integer view)."""
    out = t.clone()
    ints = out.view({4: torch.int32, 2: torch.int16}[t.element_size()]).view(-1)
    bits = ints.element_size() * 8
    ints[index] ^= signed(1 << bit, bits)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [6, COLUMNS + 5, 3 * COLUMNS], ids=["small", "two rows and a tail", "three rows"])
def test_every_single_bit_flip_of_float_elements_changes_the_fingerprint(dtype, numel):
    torch.manual_seed(2)
    t = torch.randn(numel).to(dtype)
    fp = Fingerprinter()
    clean = fp([t]).item()
    bits = t.element_size() * 8
    positions = sorted({0, 1, numel // 2, numel - 2, numel - 1, min(COLUMNS, numel - 1), min(COLUMNS - 1, numel - 1)})
    flipped = [flip(t, i, b) for i in positions for b in range(bits)]
    values = fp(flipped).tolist()  # all flips of this tensor in one batched call
    assert all(v != clean for v in values), [
        (i, b) for (i, b), v in zip([(i, b) for i in positions for b in range(bits)], values) if v == clean
    ]
    assert len(set(values)) == len(values)  # and no two flips collide with each other


def test_a_flip_changes_only_its_own_tensor_in_a_batch():
    torch.manual_seed(3)
    tensors = [torch.randn(10), torch.randn(2 * COLUMNS + 1), torch.randn(4).half()]
    fp = Fingerprinter()
    clean = fp(tensors).tolist()
    changed = fp([tensors[0], flip(tensors[1], COLUMNS + 1, 0), tensors[2]]).tolist()
    assert [a != b for a, b in zip(clean, changed)] == [False, True, False]


def test_a_norm_misses_what_the_fingerprint_sees():
    """Why a fingerprint: the lowest mantissa bit of a small element can leave the norm unchanged."""
    t = torch.tensor([1e4, 1e-6, 3.0])
    bad = flip(t, 1, 0)
    assert torch.linalg.vector_norm(bad) == torch.linalg.vector_norm(t)
    assert fingerprint(bad) != fingerprint(t)


def test_swapped_elements_change_the_fingerprint():
    t = torch.arange(20, dtype=torch.float32)
    swapped = t.clone()
    swapped[[3, 11]] = swapped[[11, 3]]
    assert fingerprint(swapped) != fingerprint(t)
    assert float(swapped.sum()) == float(t.sum())
