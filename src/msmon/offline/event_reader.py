"""TensorBoard event files read record by record, a corrupt record skipped rather than the rest
of the file lost.

tensorboard's own loader stops at the first record whose checksum fails, taking it for the
end of a file still being written, so one flipped byte silently drops every later step. Here
a record whose data checksum fails is skipped and reading goes on after it (its length, under
its own checksum, says where the next one starts); a record whose length is corrupt is skipped
by searching forward for the next position where a length and its checksum agree. A record cut
short at the very end is a file still being written: reading stops there, and it is no error.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Any

from ..records.tfrecord import masked_crc32c_function

_HEADER = 12  # uint64 length, uint32 masked CRC32C of those 8 bytes
_FOOTER = 4  # uint32 masked CRC32C of the data


class EventReader:
    """The Event protos of one file, in order; `skipped` counts the corrupt records left out."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.skipped = 0
        self._crc = masked_crc32c_function()

    def events(self) -> Iterator[Any]:
        from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
        from tensorboard.compat.proto.event_pb2 import Event

        for data in self.records():
            try:
                yield Event.FromString(data)
            except DecodeError:  # both checksums agree, yet it is no Event: written so by something else
                self.skipped += 1

    def records(self) -> Iterator[bytes]:
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            pos = 0
            while pos + _HEADER <= size:
                fh.seek(pos)
                header = fh.read(_HEADER)
                if not self._header_ok(header):
                    self.skipped += 1
                    pos = self._next_header(fh, pos + 1, size)
                    continue
                (length,) = struct.unpack("<Q", header[:8])
                end = pos + _HEADER + length + _FOOTER
                if end > size:
                    return  # cut short: the writer is not done with it
                data = fh.read(length)
                (crc,) = struct.unpack("<I", fh.read(_FOOTER))
                pos = end
                if crc != self._crc(data):
                    self.skipped += 1
                    continue
                yield data

    def _header_ok(self, header: bytes) -> bool:
        return len(header) == _HEADER and struct.unpack("<I", header[8:])[0] == self._crc(header[:8])

    def _next_header(self, fh: Any, start: int, size: int) -> int:
        """The first position from `start` on where a record header's length and checksum agree
        (the end of the file if there is none)."""
        chunk = 1 << 20
        pos = start
        while pos + _HEADER <= size:
            fh.seek(pos)
            window = fh.read(chunk + _HEADER - 1)
            for i in range(len(window) - _HEADER + 1):
                if self._header_ok(window[i : i + _HEADER]):
                    return pos + i
            pos += chunk
        return size


class _DirectoryEvents:
    """What EventAccumulator loads a directory through (its `Load()`), read with EventReader:
    the directory's event files in name order, as tensorboard's DirectoryWatcher reads them."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.readers: list[EventReader] = []

    def Load(self) -> Iterator[Any]:  # noqa: N802 (tensorboard's name)
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if "tfevents" in name and os.path.isfile(path):
                reader = EventReader(path)
                self.readers.append(reader)
                yield from reader.events()

    @property
    def skipped(self) -> dict[str, int]:
        return {r.path: r.skipped for r in self.readers if r.skipped}


def tolerant_accumulator(directory: str, size_guidance: dict) -> tuple[Any, _DirectoryEvents]:
    """An EventAccumulator of `directory` that skips corrupt records (its source of events
    replaced by _DirectoryEvents), and that source, which counts them once it was reloaded."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(directory, size_guidance=size_guidance)
    source = _DirectoryEvents(directory)
    acc._generator = source  # the one source Reload() reads; tensorboard offers no other way to pass one
    return acc, source
