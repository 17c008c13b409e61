"""Output variables written as compressed chunks straight into the NetCDF-4 (HDF5) file.

HDF5 compresses a variable's chunks one after another, on one core: on the
seed cube that was 70% of a whole run. Here each block the writer fills is cut
into the variable's chunks, which are shuffled and deflated by the filters of the
variable's own pipeline (the netCDF library defined it; any deflate stream of that
level is valid there, and any reader inflates it), on every
core at once (the compressors release the GIL), then stored with HDF5's direct
chunk write in a fixed order, so the file is the same whatever the number of cores.

Deflate levels 1-3 are compressed with ISA-L (``isal``), levels 4-9 with zlib.
Both write standard zlib streams that HDF5's deflate filter, netCDF-C, CDO and
every other reader inflate; the data read back are the same bits. On the seed
demo's chunks (shuffled float32) ISA-L's level 1 ran at 700-730 MB/s per core
against zlib's 64-67 MB/s: the write stage was most of a run. It compresses a
little less: the demo's output file is 5.7 % larger (its gradients and
coefficients 6 %). The compressed bytes differ from zlib's, and may differ
between ISA-L's code paths (SSE, AVX2, AVX-512), which the determinism promise
allows (same machine, same code path; ``stages/engine/agreement.py``).

Anything else, e.g. a block that covers chunks only in part or a filter other
than shuffle and deflate, is written the ordinary way (h5py's ``d[index] = data``).
"""

from __future__ import annotations

import collections
import itertools
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

try:
    from isal import isal_zlib
except ImportError:  # a platform without its wheel: zlib at every level
    isal_zlib = None  # type: ignore[assignment]

if TYPE_CHECKING:  # h5py is imported when a file is written, not by every run (cached ones)
    import h5py

#: The filters this module applies itself, by HDF5 filter id (H5Zpublic.h).
DEFLATE = 1
SHUFFLE = 2


def workers() -> int:
    """Threads that compress: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def pipeline(d: h5py.Dataset) -> tuple[bool, int | None] | None:
    """``(shuffle, deflate level or None)`` of chunked ``d``; None: filters this module lacks."""
    if d.chunks is None:
        return None
    plist = d.id.get_create_plist()
    filters = [plist.get_filter(i)[:3] for i in range(plist.get_nfilters())]
    shuffle = bool(filters) and filters[0][0] == SHUFFLE
    rest = filters[1:] if shuffle else filters
    if not rest:
        return shuffle, None
    if len(rest) == 1 and rest[0][0] == DEFLATE and len(rest[0][2]) == 1:
        return shuffle, int(rest[0][2][0])
    return None


def encode(chunk: np.ndarray, shuffle: bool, level: int | None) -> bytes:
    """A full chunk's bytes as HDF5 stores them after the shuffle and deflate filters."""
    raw = chunk.tobytes()
    size = chunk.dtype.itemsize
    if shuffle and size > 1:
        # HDF5's shuffle: the first byte of every element, then every second byte, …
        raw = np.frombuffer(raw, np.uint8).reshape(-1, size).T.tobytes()
    if level is None:
        return raw
    return deflate(raw, level)


#: The highest deflate level compressed with ISA-L (its levels are 0-3; 0 is not zlib's 0).
ISAL_MAX_LEVEL = 3


def deflate(raw: bytes, level: int) -> bytes:
    """``raw`` as a zlib stream, deflated at ``level`` (1-9)."""
    if isal_zlib is not None and 1 <= level <= ISAL_MAX_LEVEL:
        return isal_zlib.compress(raw, level)
    return zlib.compress(raw, level)


def _chunk_starts(
    index: tuple[slice, ...], shape: tuple[int, ...], chunks: tuple[int, ...]
) -> list[range] | None:
    """Per dim, the starts of the chunks ``index`` covers; None if it covers any only in part."""
    out = []
    for s, n, c in zip(index, shape, chunks, strict=True):
        start, stop = s.start, s.stop
        if start % c or (stop % c and stop != n):
            return None
        out.append(range(start, stop, c))
    return out


class ChunkWriter:
    """Writes blocks of an open file's chunked variables; a context manager that closes it."""

    def __init__(self, path: str | os.PathLike[str], threads: int | None = None) -> None:
        import h5py

        # netCDF-C's chunk cache is larger than h5py's 1 MiB default; blocks written
        # the ordinary way over parts of chunks would otherwise recompress them per block
        self.file = h5py.File(path, "r+", rdcc_nbytes=64 * 2**20)
        n = threads or workers()
        self.pool = ThreadPoolExecutor(n)
        self.window = 4 * n  # chunks in flight: enough to keep every thread busy
        #: blocks stored as chunks compressed here, and blocks written the ordinary way
        self.direct = self.ordinary = 0

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.file.close()

    def write(self, name: str, index: tuple[slice, ...], data: np.ndarray) -> None:
        """Store ``data`` at ``index`` (a slice with start and stop for every dim) of ``name``."""
        d = self.file[name]
        data = np.asarray(data, dtype=d.dtype)
        if None in d.maxshape:  # an unlimited dim: HDF5 holds only what was written so far
            grown = tuple(
                max(n, s.stop) if m is None and s.stop is not None else n
                for s, n, m in zip(index, d.shape, d.maxshape, strict=True)
            )
            if grown != d.shape:
                d.resize(grown)
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, d.shape, strict=True))
        if data.shape != tuple(s.stop - s.start for s in index):
            raise ValueError(f"a block of shape {data.shape} written to {index} of {name!r}")
        how = pipeline(d)
        starts = _chunk_starts(index, d.shape, d.chunks) if how is not None else None
        if how is None or starts is None:
            d[index] = data
            self.ordinary += 1
            return
        # A window of chunks in flight, written as they come back in order: at most that
        # many compressed copies beside the data (not the whole block's, up front).
        window: collections.deque[tuple[tuple[int, ...], Future[bytes]]] = collections.deque()
        for job in self._encode(d, index, data, starts, *how):
            window.append(job)
            if len(window) >= self.window:
                offset, done = window.popleft()
                d.id.write_direct_chunk(offset, done.result())
        while window:
            offset, done = window.popleft()
            d.id.write_direct_chunk(offset, done.result())
        self.direct += 1

    def _encode(
        self,
        d: h5py.Dataset,
        index: tuple[slice, ...],
        data: np.ndarray,
        starts: list[range],
        shuffle: bool,
        level: int | None,
    ) -> Iterator[tuple[tuple[int, ...], Future[bytes]]]:
        chunks: tuple[int, ...] = d.chunks
        pad: Any = d.fillvalue if d.fillvalue is not None else 0
        for offset in itertools.product(*starts):
            part = tuple(
                slice(o - s.start, min(o + c, s.stop) - s.start)
                for o, s, c in zip(offset, index, chunks, strict=True)
            )
            block = data[part]
            if block.shape != chunks:  # at the variable's far edge: HDF5 stores whole chunks
                full = np.full(chunks, pad, dtype=d.dtype)
                full[tuple(slice(0, n) for n in block.shape)] = block
                block = full
            # a view: the worker's tobytes() makes the one copy, in C order
            yield offset, self.pool.submit(encode, block, shuffle, level)
