"""A step's TensorBoard scalars as Summary bytes, without one protobuf object per scalar.

Building a `Summary.Value` per scalar through the protobuf classes was the writer thread's
largest cost: about 3 µs each, and the bundled example records 5 000 scalars per step. A
scalar's Value is its tag (field 1) and its float32 (field 2), so its bytes are a prefix fixed
by the tag, kept from step to step, followed by the four bytes of the value; a repeated field
is the concatenation of its entries, so histograms and images, still built with the protobuf
classes, are appended as serialized entries. The bytes are those `SerializeToString` gives
(tests/unit/sinks/test_summary_wire.py compares them).
"""

from __future__ import annotations

import ctypes
import struct
import sys

import torch

_DOUBLE = struct.Struct("<d")


def varint(n: int) -> bytes:
    """A non-negative integer as protobuf's base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def scalar_prefix(tag: str) -> bytes:
    """Summary.value entry of a scalar up to its value: entry key and length, the tag, the
    simple_value key (field 2, 32-bit)."""
    raw = tag.encode("utf-8")
    value = b"\x0a" + varint(len(raw)) + raw + b"\x15"
    return b"\x0a" + varint(len(value) + 4) + value


def float32_bytes(values: torch.Tensor) -> bytes:
    """The values rounded to float32 as protobuf does (±inf beyond its range), little-endian,
    in row order."""
    flat = values.detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1)
    if not flat.numel():
        return b""
    if sys.byteorder == "little":
        return ctypes.string_at(flat.data_ptr(), flat.numel() * 4)
    return struct.pack(f"<{flat.numel()}f", *flat.tolist())  # already float32: packs exactly


def scalars(prefixes: list[bytes], value_bytes: bytes) -> bytes:
    """Entries for `prefixes[i]` with the i-th float32 of `value_bytes`."""
    parts: list[bytes] = [b""] * (2 * len(prefixes))
    parts[0::2] = prefixes
    parts[1::2] = [value_bytes[i : i + 4] for i in range(0, 4 * len(prefixes), 4)]
    return b"".join(parts)


def entry(serialized_value: bytes) -> bytes:
    """A Summary.value entry from a serialized Summary.Value (a histogram, an image)."""
    return b"\x0a" + varint(len(serialized_value)) + serialized_value


def event(wall_time: float, step: int, summary: bytes) -> bytes:
    """An Event holding wall_time, step (left out when 0, as proto3 does) and the summary."""
    head = b"\x09" + _DOUBLE.pack(wall_time) + (b"\x10" + varint(step) if step else b"")
    return head + b"\x2a" + varint(len(summary)) + summary
