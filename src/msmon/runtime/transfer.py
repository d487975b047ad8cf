"""The one device-to-host copy per step, without blocking the training thread.

Rows recorded on an accelerator are concatenated there, copied into pinned host memory with a
non-blocking copy, and an event is recorded; the writer thread waits on the event, never the
training thread. CPU rows are simply concatenated.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..records.rows import RowKey
from .buffer import Histogram


@dataclass
class HostBatch:
    """A step's rows on their way to the host; `wait()` blocks until they are there."""

    keys: list[RowKey]
    values: torch.Tensor
    histograms: list[tuple[str, list[float], torch.Tensor]] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    flag_keys: list[RowKey] = field(default_factory=list)
    flag_values: torch.Tensor | None = None

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()

    def finite_flags(self) -> list[bool]:
        return [] if self.flag_values is None else [bool(v) for v in self.flag_values.tolist()]


def _to_host(t: torch.Tensor, events: list[Any]) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    module = getattr(torch, t.device.type, None)
    event_cls = getattr(module, "Event", None) if module is not None else None
    if event_cls is not None:
        event = event_cls()
        event.record()
        events.append(event)
    else:  # an accelerator without events: fall back to a blocking copy
        host = t.to("cpu")
    return host


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
    """Start copying `t` to the host: (the host tensor, events to wait on before reading it)."""
    events: list[Any] = []
    return _to_host(t, events), events


def stage_to_host(
    keys: list[RowKey],
    chunks: list[torch.Tensor],
    width: int,
    histograms: list[Histogram],
    flag_keys: list[RowKey] | None = None,
    flags: torch.Tensor | None = None,
) -> HostBatch:
    """Concatenate each device's rows and start their copy to the host. Finiteness flags
    travel in the same copy as the rows of their device."""
    events: list[Any] = []
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, chunk in enumerate(chunks):
        by_device[chunk.device].append(i)
    ordered_keys: list[RowKey] = []
    host_parts: list[torch.Tensor] = []
    # keys were appended chunk by chunk; recover which keys belong to which chunk
    spans, start = [], 0
    for chunk in chunks:
        spans.append((start, start + chunk.shape[0]))
        start += chunk.shape[0]
    flag_device = flags.device if flags is not None else None
    flag_host: torch.Tensor | None = None
    for device, indices in by_device.items():
        device_rows = torch.cat([chunks[i] for i in indices]) if len(indices) > 1 else chunks[indices[0]]
        if flags is not None and device == flag_device:  # pack the flags after the rows: still one copy
            packed = torch.cat([device_rows.flatten(), flags.to(device_rows.dtype)])
            host = _to_host(packed, events)
            split = device_rows.numel()
            host_parts.append(host[:split].view(device_rows.shape))
            flag_host = host[split:]
        else:
            host_parts.append(_to_host(device_rows, events))
        for i in indices:
            ordered_keys.extend(keys[spans[i][0] : spans[i][1]])
    if flags is not None and flag_host is None:
        flag_host = _to_host(flags.to(torch.float64), events)
    if host_parts:
        values = host_parts[0] if len(host_parts) == 1 else torch.cat(host_parts)
    else:
        values = torch.empty((0, width), dtype=torch.float64)
    hist_host = [(h.tag, h.edges, _to_host(h.counts, events)) for h in histograms]
    return HostBatch(ordered_keys, values, hist_host, events, list(flag_keys or []), flag_host)
