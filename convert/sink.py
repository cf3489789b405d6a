"""Write an output file made of small byte segments (headers, pickle opcodes) and large tensor regions.

Every format we write is laid out up front: headers are small and computed first, and each
tensor's place in the file is known from its shape. So the file is reserved in full
(posix_fallocate: a full disk fails here, cleanly, not halfway through) and then written
front to back through `SequentialFile`, a ring of page-aligned blocks: the tensor parts
(layers, or bands of rows) are mapped from the source and transposed, cast or copied by two
worker threads straight into their place in the ring (numpy copies drop the GIL), and each
block, once complete, is written with O_DIRECT where the filesystem allows it, so the bytes
go from the ring to the device with no further copy. On the benchmark VM that made writing a
2.55 GB file 4-6x faster than through the page cache (page-cache pages for a new file cost a
host page fault each) and takes no page cache from the user's other files. That pays from about
a gigabyte on; files below RING_FROM (every published Needle checkpoint) are written by the plain
writer, part by part through the page cache, which measured as fast or faster there.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from convert.plan import Planned

Segment = bytes | Planned
Check = Callable[[str, np.ndarray], None]
_WORKERS = 2  # threads making parts (on 2 cores: the writer thread mostly waits on the disk)
_BLOCK = 8 * 2**20  # bytes per write; a multiple of every device block size O_DIRECT may require
_BLOCKS = 6  # blocks in the ring: one being written, the others being filled by parts made ahead
_NICE = 10  # worker threads' priority below the hash thread's
_ALIGN = 4096  # O_DIRECT alignment of offsets and lengths (the largest common logical block size)


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


# The writer for a file of a given size (the one seam): "plain" writes part by part through the page cache,
# "ring" is the O_DIRECT ring below; NEEDLE_TWIN_WRITER=plain|ring forces one. Plain is as fast and smaller at
# the published sizes, the ring faster from RING_FROM on (benchmarks/bench_convert.py, docs/PERFORMANCE.md).
WRITERS = ("plain", "ring")
RING_FROM = 2**30


def write_file(path: Path, segments: Sequence[Segment], *, on_bytes: Callable[[int], None] | None = None,
               check: Check | None = None, pipeline: bool = True, writer: str | None = None) -> None:
    """Create path (it must not exist) with the segments in order; `check` sees every tensor part written."""
    items = _layout(segments)
    total = sum(n for _, n, _ in items)
    kind = writer or os.environ.get("NEEDLE_TWIN_WRITER") or ("ring" if total >= RING_FROM else "plain")
    if kind not in WRITERS:
        raise ValueError(f"NEEDLE_TWIN_WRITER={kind!r}; use one of {', '.join(WRITERS)}")
    if kind == "plain":
        _write_plain(path, items, total, on_bytes, check)
        return
    largest = max((n for _, n, _ in items), default=0)
    with SequentialFile(path, total, largest) as out:
        _stream(out, items, on_bytes, check, pipeline)


def _write_plain(path: Path, items: list[Item], total: int, on_bytes: Callable[[int], None] | None,
                 check: Check | None) -> None:
    """One thread, front to back: each part is made into a reused buffer and written with one write() call."""
    scratch, buffer = _Scratch(), np.empty(0, np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _reserve(fd, total)
        for kind, nbytes, payload in items:
            if kind == "bytes":
                _write_all(fd, memoryview(payload))
            elif kind == "part":
                name, make = payload
                if buffer.size < nbytes:
                    buffer = np.empty(nbytes, np.uint8)
                part = make(buffer[:nbytes], scratch)
                if check is not None:
                    check(name, part)
                _write_all(fd, memoryview(buffer[:nbytes]))
            elif on_bytes is not None:
                on_bytes(payload)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


class SequentialFile:
    """A new file written front to back from a ring: file byte o lives at ring[o % ring size] from when it is
    put there until its block is written (with O_DIRECT when available, on a writer thread). Blocks go out in
    file order, each once every byte of it is in place; the padded last block is cut back afterwards."""

    def __init__(self, path: Path, total: int, largest: int = 0) -> None:
        self.path, self.total = path, total
        # Room for the largest item with a block to spare, so waiting for room always ends (see `room`); a file
        # smaller than that needs no more than itself. Past the ring's end, an overhang as big as the largest
        # item: an item the wrap cuts is made whole there, and its overhanging end then moved to the front.
        blocks = min(max(_BLOCKS, math.ceil(largest / _BLOCK) + 2), max(1, math.ceil(total / _BLOCK)))
        self.size = blocks * _BLOCK
        self._map = _anonymous_map(self.size + (largest if total > self.size else 0))
        self.ring = np.frombuffer(self._map, np.uint8)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _reserve(self.fd, total)
            self.direct = _set_direct(self.fd, True)  # False where the filesystem or platform has none
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="needle-twin-write")
        except BaseException:
            os.close(self.fd)
            raise
        self._writes: deque[tuple[int, Future]] = deque()  # (end offset, write) in flight, in file order
        self.produced = 0  # every byte before this offset is in the ring
        self._submitted = 0  # bytes handed to the writer
        self.written = 0  # bytes on disk: ring positions of offsets below written + size are free

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Where file bytes [offset, offset + nbytes) are made: their ring bytes, running into the overhang
        when the ring wraps inside them (`fold` then puts those in place)."""
        at = offset % self.size
        return self.ring[at:at + nbytes]

    def fold(self, offset: int, nbytes: int) -> None:
        """Move the overhanging end of file bytes [offset, offset + nbytes), if any, to the ring's front."""
        end = offset % self.size + nbytes
        if end > self.size:
            self.ring[:end - self.size] = self.ring[self.size:end]

    def put(self, offset: int, data: bytes) -> None:
        """Copy data into the ring as file bytes [offset, offset + len(data))."""
        self.view(offset, len(data))[:] = np.frombuffer(data, np.uint8)
        self.fold(offset, len(data))

    def room(self, end: int) -> bool:
        """Whether file bytes up to `end` can be put in the ring now (their ring positions' bytes are written)."""
        while self._writes and self._writes[0][1].done():
            self._retire_write()
        return end <= self.written + self.size

    def writing(self) -> bool:
        return bool(self._writes)

    def wait_write(self) -> None:
        """Wait for the oldest write in flight."""
        self._retire_write()

    def produced_to(self, offset: int) -> None:
        """Every byte before `offset` is in the ring: hand each block that is now complete to the writer."""
        self.produced = offset
        while self._submitted + _BLOCK <= offset:
            self._submit(_BLOCK)

    def _submit(self, nbytes: int) -> None:
        at = self._submitted
        self._writes.append((at + nbytes, self._writer.submit(self._write, at % self.size, nbytes, at)))
        self._submitted += nbytes

    def _retire_write(self) -> None:
        end, write = self._writes.popleft()
        write.result()
        self.written = min(end, self.total)

    def _write(self, start: int, nbytes: int, at: int) -> None:
        """pwrite ring[start:start + nbytes] at file offset `at` (multiples of _ALIGN, as O_DIRECT needs)."""
        data = memoryview(self._map)[start:start + nbytes]
        while data:
            try:
                n = os.pwrite(self.fd, data, at)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self.direct = _set_direct(self.fd, False)  # the filesystem took O_DIRECT at open, not here
                continue
            data, at = data[n:], at + n

    def finish(self) -> None:
        """Write the last block (padded with zeros for O_DIRECT, then cut back), wait for every write."""
        if self.produced != self.total:
            raise AssertionError(f"{self.path}: {self.produced} bytes made, {self.total} planned")
        tail = self.total - self._submitted
        if tail:
            padded = -(-tail // _ALIGN) * _ALIGN if self.direct else tail  # O_DIRECT writes whole blocks
            start = self._submitted % self.size
            self.ring[start + tail:start + padded] = 0
            self._submit(padded)
        while self._writes:
            self._retire_write()
        if self._submitted != self.total:
            os.ftruncate(self.fd, self.total)  # cut the last block's zero padding

    def __enter__(self) -> SequentialFile:
        return self

    def __exit__(self, kind, value, tb) -> None:
        failed = kind is not None
        try:
            if not failed:
                self.finish()
        except BaseException:
            failed = True  # e.g. a write failing in finish: the writes queued behind it are dropped too
            raise
        finally:
            # A write in flight finishes before the ring and fd go; after an error, queued ones are dropped.
            self._writer.shutdown(wait=True, cancel_futures=failed)
            os.close(self.fd)
            del self.ring
            try:
                self._map.close()
            except BufferError:  # a part's view is still held (by an error's traceback): unmapped with it
                pass


def _anonymous_map(nbytes: int) -> mmap.mmap:
    """Private, page-aligned memory (as O_DIRECT needs), in huge pages where the kernel offers them: fewer
    first-touch faults."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    m = mmap.mmap(-1, nbytes, flags=flags) if flags else mmap.mmap(-1, nbytes)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages it is
            pass
    return m


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for fd; returns whether it is on."""
    flag = getattr(os, "O_DIRECT", 0)  # Linux, FreeBSD; not macOS or Windows
    if not flag:
        return False
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | flag if on else flags & ~flag)
        return on
    except OSError:  # e.g. tmpfs refuses O_DIRECT: EINVAL
        return False


def _reserve(fd: int, total: int) -> None:
    """Allocate the whole file up front: a full disk fails here, before any work (where supported)."""
    if total == 0:
        return
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise  # ENOSPC, EDQUOT, EFBIG: the caller reports it and removes the file


# One item of a file's layout, in file order: (kind, nbytes, payload) with kind "bytes" (payload: the bytes),
# "part" (payload: (tensor name, make)) or "done" (a tensor is complete; nbytes 0, payload its size).
Item = tuple[str, int, object]


def _layout(segments: Sequence[Segment]) -> list[Item]:
    items: list[Item] = []
    for segment in segments:
        if isinstance(segment, bytes):
            items.append(("bytes", len(segment), segment))
        else:
            items += [("part", nbytes, (segment.name, make)) for nbytes, make in segment.jobs()]
            items.append(("done", 0, segment.nbytes))
    return items


class _Scratch(threading.local):
    """A per-thread growable buffer for a transpose's working block, reused from part to part: fresh memory is
    dear on a VM (zeroing a 96 MiB ring's new pages took 9% of a conversion's CPU samples on the benchmark)."""

    def __init__(self) -> None:
        self.buffer = np.empty(0, np.uint8)

    def __call__(self, nbytes: int) -> np.ndarray:
        if self.buffer.size < nbytes:
            self.buffer = np.empty(nbytes, np.uint8)
        return self.buffer[:nbytes]


def _make(out: SequentialFile, offset: int, nbytes: int, name: str, make: Callable, check: Check | None,
          scratch: _Scratch) -> None:
    """Make one part in its place in the ring, check it, and fold it where the ring wraps inside it."""
    part = make(out.view(offset, nbytes), scratch)
    if check is not None:
        check(name, part)
    out.fold(offset, nbytes)


def _yield_to_hash() -> None:
    """Lower this worker thread's priority: the source hash (one thread, the conversion's critical path) then
    runs at full speed while the workers take the rest of the cores. Linux only: there a thread id names one
    thread for setpriority; elsewhere priorities are per process (a thread id is not a process id)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + _NICE)
        except OSError:
            pass


class _Inline:
    """The executor interface, run on the calling thread (pipeline=False)."""

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def _stream(out: SequentialFile, items: list[Item], on_bytes: Callable[[int], None] | None, check: Check | None,
            pipeline: bool) -> None:
    """Put the items in the ring in file order: bytes at once, parts by _WORKERS threads (made ahead of the
    writes as far as the ring has room). A block goes to the writer once all its items are in place."""
    pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="needle-twin-part", initializer=_yield_to_hash) \
        if pipeline else _Inline()
    scratch = _Scratch()
    pending: deque[tuple[int, Future | None, int]] = deque()  # (end offset, part being made, progress bytes)
    try:
        offset = 0
        for kind, nbytes, payload in items:
            while not out.room(offset + nbytes):  # writes free room: wait for one, else for the oldest part
                _retire_done(out, pending, on_bytes)
                if out.writing():
                    out.wait_write()
                else:
                    _retire(out, pending, on_bytes)
            if kind == "bytes":
                out.put(offset, payload)
                pending.append((offset + nbytes, None, 0))
            elif kind == "part":
                name, make = payload
                pending.append((offset + nbytes, pool.submit(_make, out, offset, nbytes, name, make, check,
                                                              scratch), 0))
            else:
                pending.append((offset, None, payload))
            offset += nbytes
            _retire_done(out, pending, on_bytes)  # complete blocks go out as early as possible
        while pending:
            _retire(out, pending, on_bytes)
    finally:
        for _, future, _ in pending:  # on an error: don't start parts nobody will write
            if future is not None:
                future.cancel()
        pool.shutdown(wait=True)


def _retire_done(out: SequentialFile, pending: deque, on_bytes: Callable[[int], None] | None) -> None:
    while pending and (pending[0][1] is None or pending[0][1].done()):
        _retire(out, pending, on_bytes)


def _retire(out: SequentialFile, pending: deque, on_bytes: Callable[[int], None] | None) -> None:
    end, future, progress = pending.popleft()
    if future is not None:
        future.result()
    out.produced_to(end)
    if progress and on_bytes is not None:
        on_bytes(progress)
