"""Update/ratio heatmaps (`heatmap_visualize`): msprobe's HeatmapVisualizer without matplotlib.

msprobe (pytorch/monitor/visualizer.py) keeps, per parameter, the histogram of `update` and of
`ratio` of every recorded step and, at each recorded step, draws the whole matrix (value buckets
down, lowest values on top; steps across) with matplotlib's "hot" colormap scaled from the
matrix's smallest to its largest count, into TensorBoard images tagged
`{name}/rank{r}/adam_update` and `{name}/rank{r}/adam_ratio`.

msmon builds the same matrix on the writer thread from the histogram counts the device already
computed for ur_distribution (32 buckets over [-1, 1], outliers in the end buckets), one pixel
per cell and no axes, and encodes the PNG itself (zlib): no figure is rendered, no extra device
work, no dependency. The newest MAX_COLUMNS steps are kept, so memory and image size stay bounded
(an image of 32 x 1024 incompressible counts: about 5 ms of writer-thread CPU, 53 kB).
"""

from __future__ import annotations

import functools
import struct
import zlib

import torch

MAX_COLUMNS = 1024
CATEGORIES = {"update_hist": "adam_update", "ratio_hist": "adam_ratio"}  # histogram tag end -> image tag end


class Heatmaps:
    """One growing buckets x steps matrix per histogram tag; `add` returns the image to write."""

    def __init__(self, max_columns: int = MAX_COLUMNS) -> None:
        self._max_columns = max_columns
        self._matrices: dict[str, torch.Tensor] = {}  # [buckets, max_columns], filled left to right
        self._filled: dict[str, int] = {}

    def add(self, hist_tag: str, counts: list[float]) -> tuple[str, int, int, bytes] | None:
        """Append this step's counts; (image tag, height, width, PNG) or None for other histograms."""
        prefix, _, kind = hist_tag.rpartition("/")
        suffix = CATEGORIES.get(kind)
        if suffix is None or not prefix:
            return None
        column = torch.tensor(counts, dtype=torch.float32)
        matrix = self._matrices.get(hist_tag)
        if matrix is None or matrix.shape[0] != column.numel():
            matrix = self._matrices[hist_tag] = torch.zeros(column.numel(), self._max_columns)
            self._filled[hist_tag] = 0
        width = self._filled[hist_tag]
        if width == self._max_columns:  # full: the oldest step leaves on the left
            matrix[:, :-1] = matrix[:, 1:].clone()
            width -= 1
        matrix[:, width] = column
        width = self._filled[hist_tag] = width + 1
        height = matrix.shape[0]
        matrix = matrix[:, :width]
        return f"{prefix}/{suffix}", height, width, encode_png(hot_colormap(matrix))


@functools.cache
def _hot_lut() -> torch.Tensor:
    """matplotlib's "hot" map in 256 steps (black, red, yellow, white): red rises over the first
    36.5 %, green up to 74.6 %, blue up to 100 %. Built at the first heatmap, not at import: its
    first torch ops map about 5 MiB of libtorch's code into every monitored process otherwise."""
    x = torch.linspace(0, 1, 256, dtype=torch.float64)
    red = (0.0416 + x * (1 - 0.0416) / 0.365079).clamp(0, 1)
    green = ((x - 0.365079) / (0.746032 - 0.365079)).clamp(0, 1)
    blue = ((x - 0.746032) / (1 - 0.746032)).clamp(0, 1)
    return (torch.stack([red, green, blue], dim=-1) * 255).round().to(torch.uint8)


def hot_colormap(matrix: torch.Tensor) -> torch.Tensor:
    """[H, W] values -> [H, W, 3] uint8: scaled from the smallest to the largest value, as matshow
    does, then looked up in the "hot" map."""
    low, high = matrix.min(), matrix.max()
    x = (matrix - low) / (high - low) if high > low else torch.zeros_like(matrix)
    return _hot_lut()[(x * 255).round().long()]


def encode_png(rgb: torch.Tensor) -> bytes:
    """An 8-bit RGB PNG of a [H, W, 3] uint8 tensor: IHDR, one zlib IDAT (filter 0 rows), IEND."""
    height, width, _ = rgb.shape
    rows = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rgb.reshape(height, width * 3)], dim=1)
    try:
        raw = rows.contiguous().numpy().tobytes()
    except (RuntimeError, ImportError):  # torch without numpy
        raw = bytes(rows.flatten().tolist())

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b"")
