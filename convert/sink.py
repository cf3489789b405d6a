"""Write an output file made of small byte segments (headers, pickle opcodes) and large tensor regions.

Every format we write is laid out up front: headers are small and computed first, and each
tensor's place in the file is known from its shape. So the file is reserved in full
(posix_fallocate: a full disk fails here, cleanly, not halfway through), the small segments
are written, and then each tensor is written at its offset, part by part (a layer at a time),
while the next part is read, transposed, cast and checked on a second thread (numpy copies,
pread and pwrite drop the GIL). Parts go through a few reused buffers, never fresh memory;
on the benchmark VM this beat filling mapped output pages by 2-5x (a page fault per 4 KiB).
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from convert.plan import Planned

Segment = bytes | Planned
_LANES = 3  # parts in flight: one being produced, one queued, one being written


class Segments:
    """Collects a file's layout: raw bytes as they are written, with tensors as placeholders."""

    def __init__(self) -> None:
        self.items: list[Segment] = []
        self._pending = bytearray()

    def write(self, data: bytes) -> None:
        self._pending += data

    def tensor(self, planned: Planned) -> None:
        self._flush()
        self.items.append(planned)

    def done(self) -> list[Segment]:
        self._flush()
        return self.items

    def _flush(self) -> None:
        if self._pending:
            self.items.append(bytes(self._pending))
            self._pending = bytearray()


def write_file(path: Path, segments: Sequence[Segment], *, on_bytes: Callable[[int], None] | None = None,
               check: Callable[[str, np.ndarray], None] | None = None, pipeline: bool = True) -> None:
    """Create path (it must not exist) with the segments in order; `check` sees every tensor part written."""
    total = sum(len(s) if isinstance(s, bytes) else s.nbytes for s in segments)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _reserve(fd, total)
        regions, offset = [], 0
        for segment in segments:
            if isinstance(segment, bytes):
                _pwrite_all(fd, segment, offset)
                offset += len(segment)
            else:
                regions.append((segment, offset))
                offset += segment.nbytes
        _fill_regions(fd, regions, on_bytes, check, pipeline)
    finally:
        os.close(fd)


def _reserve(fd: int, total: int) -> None:
    """Allocate the whole file up front: a full disk fails here, before any work (where supported)."""
    if total == 0:
        return
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise  # ENOSPC, EDQUOT, EFBIG: the caller reports it and removes the file


def _pwrite_all(fd: int, data: bytes | np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class _Lane:
    """A pair of growable buffers one part is read and transposed in; reused from part to part, so the
    writer never touches fresh memory (first touches of new pages are what cost most on a VM)."""

    def __init__(self) -> None:
        self.buffers = [np.empty(0, np.uint8), np.empty(0, np.uint8)]

    def __call__(self, slot: int, nbytes: int) -> np.ndarray:
        if self.buffers[slot].size < nbytes:
            self.buffers[slot] = np.empty(nbytes, np.uint8)
        return self.buffers[slot][:nbytes]


def _fill_regions(fd: int, regions: list[tuple[Planned, int]], on_bytes: Callable[[int], None] | None,
                  check: Callable[[str, np.ndarray], None] | None, pipeline: bool) -> None:
    """Produce the parts (read, transpose, cast, check) and write them; with `pipeline`, production runs on a
    second thread ahead of the writes. Writes stay on one thread: concurrent pwrites to one file contend on
    its lock and were measured 2-8x slower in total."""
    if not pipeline:
        lane = _Lane()
        for planned, offset in regions:
            for at, part in planned.parts(lane):
                if check is not None:
                    check(planned.name, part)
                _pwrite_all(fd, part.reshape(-1).view(np.uint8), offset + at)
            if on_bytes is not None:
                on_bytes(planned.nbytes)
        return
    free: queue.Queue = queue.Queue()  # lanes nobody is using
    for _ in range(_LANES):
        free.put(_Lane())
    ready: queue.Queue = queue.Queue()  # ("part", offset, array, lane) | ("done", nbytes) | ("end",) | ("error", e)
    stop = threading.Event()

    def produce() -> None:
        try:
            for planned, offset in regions:
                current = [free.get()]
                for at, part in planned.parts(lambda slot, n, current=current: current[0](slot, n)):
                    if stop.is_set():
                        return
                    if check is not None:
                        check(planned.name, part)
                    ready.put(("part", offset + at, part, current[0]))
                    current[0] = free.get()  # the next part must not overwrite one still waiting to be written
                free.put(current[0])
                ready.put(("done", planned.nbytes))
            ready.put(("end",))
        except BaseException as e:  # handed to the writer, which re-raises it
            ready.put(("error", e))

    producer = threading.Thread(target=produce, name="needle-twin-produce", daemon=True)
    producer.start()
    try:
        while True:
            message = ready.get()
            if message[0] == "end":
                break
            if message[0] == "error":
                raise message[1]
            if message[0] == "done":
                if on_bytes is not None:
                    on_bytes(message[1])
                continue
            _, at, part, lane = message
            _pwrite_all(fd, part.reshape(-1).view(np.uint8), at)
            free.put(lane)
    finally:
        stop.set()
        while producer.is_alive():  # unblock a producer waiting for a free lane, then let it finish
            free.put(_Lane())
            producer.join(timeout=0.05)
