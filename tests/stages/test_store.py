"""The content-addressed store: atomic, verified, concurrent-safe, self-healing."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gridsolve.schemas.errors import StoreError
from gridsolve.stages.engine import versions
from gridsolve.stages.engine.pyparse import PARSE_LOCK
from gridsolve.stages.engine.store import StageOutput, Store

KEY = "0123456789abcdef0123456789abcdef"


def _out() -> StageOutput:
    return StageOutput(
        arrays={"a": np.arange(6.0).reshape(2, 3), "b": np.array([1, 2], np.int8)}, meta={"m": 1}
    )


def test_put_then_get_round_trips(store: Store) -> None:
    art = store.put(KEY, _out(), {"kind": "t"})
    np.testing.assert_array_equal(art.array("a"), np.arange(6.0).reshape(2, 3))
    assert art.array("b").dtype == np.int8
    assert art.meta == {"m": 1} and art.info["kind"] == "t"
    assert store.check(KEY) == ("hit", "")
    assert store.check("f" * 32)[0] == "miss"


def test_corrupt_artifact_is_detected_and_moved_aside(store: Store) -> None:
    store.put(KEY, _out(), {})
    Store._verified.clear()  # a new process would verify from scratch
    f = store.path(KEY) / "a0.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    status, why = store.lookup(KEY)
    assert status == "corrupt" and "checksum" in why
    assert not store.path(KEY).exists()
    assert any(p.name.startswith(KEY) for p in (store.root / "corrupt").iterdir())
    with pytest.raises(StoreError, match="not in the cache"):
        store.get(KEY)


def test_missing_file_or_manifest_is_corrupt(store: Store) -> None:
    store.put(KEY, _out(), {})
    (store.path(KEY) / "a1.npy").unlink()
    assert store.check(KEY)[0] == "corrupt"
    store.lookup(KEY)
    store.put(KEY, _out(), {})
    (store.path(KEY) / "manifest.json").unlink()
    assert store.check(KEY)[0] == "corrupt"


def test_second_writer_of_a_key_keeps_the_first(store: Store) -> None:
    store.put(KEY, _out(), {})
    manifest = json.loads((store.path(KEY) / "manifest.json").read_text())
    store.put(KEY, _out(), {})
    assert json.loads((store.path(KEY) / "manifest.json").read_text()) == manifest
    assert list((store.root / "tmp").iterdir()) == []


def _writer(root: str, n: int) -> None:
    s = Store(root)
    for _ in range(n):
        s.put(KEY, _out(), {})


def test_concurrent_processes_writing_one_key(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), 20)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    s = Store(tmp_path)
    Store._verified.clear()
    assert s.check(KEY) == ("hit", "")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_leftovers_of_dead_writers_are_swept(tmp_path: Path) -> None:
    s = Store(tmp_path)
    dead = tmp_path / "tmp" / f"{socket.gethostname()}~999999999~abc"
    dead.mkdir()
    alive = tmp_path / "tmp" / f"{socket.gethostname()}~{os.getpid()}~abc"
    alive.mkdir()
    Store(s.root)
    assert not dead.exists() and alive.exists()


def test_unwritable_root_is_a_clear_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        target = Path("/proc/gridsolve-cache")  # not creatable even by root
    else:
        target = tmp_path / "ro" / "cache"
        (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(StoreError, match="cache"):
        Store(target)


def _waits_for_the_parse_lock(fn: Callable[[], object]) -> object:
    """``fn()`` run in a thread while this thread holds the parse lock: it must wait for it."""
    done: list[object] = []
    with PARSE_LOCK:
        worker = threading.Thread(target=lambda: done.append(fn()))
        worker.start()
        worker.join(0.3)
        assert worker.is_alive() and not done, "parsed while another thread held the parse lock"
    worker.join(10)
    assert len(done) == 1
    return done[0]


def test_reading_an_array_waits_for_other_threads_parses(store: Store) -> None:
    # CPython 3.11's ast constructor is not thread-safe (gh-106905) and np.load parses
    # each header with ast: the write stage's threads once failed with
    # "AST constructor recursion depth mismatch".
    art = store.put(KEY, _out(), {"kind": "t"})
    got = _waits_for_the_parse_lock(lambda: art.array("a"))
    np.testing.assert_array_equal(np.asarray(got), np.arange(6.0).reshape(2, 3))


def test_parsing_source_for_code_versions_waits_for_other_threads_parses(tmp_path: Path) -> None:
    pkg = tmp_path / f"gs_lock_{uuid.uuid4().hex[:8]}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text(f"X = {uuid.uuid4().int}\n")  # never parsed before, anywhere
    sys.path.insert(0, str(tmp_path))
    try:
        got = _waits_for_the_parse_lock(lambda: versions.code_digest([f"{pkg.name}.m"]))
        assert isinstance(got, str) and len(got) == 32
    finally:
        sys.path.remove(str(tmp_path))


def test_arrays_in_the_other_byte_order_are_stored_in_this_machines(store: Store) -> None:
    # A plugin stage may return big-endian arrays (NetCDF-3 data); torch reads no such array.
    a = np.arange(6.0).reshape(2, 3)
    other = a.astype(a.dtype.newbyteorder())
    art = store.put(KEY, StageOutput(arrays={"a": other}, meta={}), {"kind": "t"})
    got = art.array("a")
    assert got.dtype.isnative and got.dtype == np.float64
    np.testing.assert_array_equal(got, a)


def test_a_thread_holding_the_parse_lock_may_read_an_array(store: Store) -> None:
    # The model stage's first compile holds the lock; anything under it that reads a
    # header must not wait for itself.
    art = store.put(KEY, _out(), {"kind": "t"})
    done: list[np.ndarray] = []

    def read_under_the_lock() -> None:
        with PARSE_LOCK:
            done.append(art.array("a"))

    worker = threading.Thread(target=read_under_the_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "a read under the parse lock waited for itself"
    np.testing.assert_array_equal(done[0], np.arange(6.0).reshape(2, 3))


def _staged_output(staged: Any) -> tuple[StageOutput, dict[str, np.ndarray]]:
    """Arrays filled in place (staged), a view of one of them, and one made in memory."""
    a = staged.empty((3, 4, 5), np.float32)
    a[...] = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    b = staged.empty((4, 5), np.int8)
    b[...] = 7
    c = staged.empty((2, 10), np.float64)
    c[...] = np.linspace(0, 1, 20).reshape(2, 10)
    arrays = {
        "a": a,  # whole: moved in as it is
        "b": b,
        "c_view": c.reshape(4, 5),  # another shape: written the usual way
        "d": np.ones(3),  # made in memory
    }
    expected = {k: np.array(v) for k, v in arrays.items()}
    return StageOutput(arrays=arrays, meta={"m": 1}), expected


def test_staged_outputs_are_stored_byte_for_byte_as_written_ones(mappable_tmp: Path) -> None:
    tmp_path = mappable_tmp
    staged_store, written_store = Store(tmp_path / "s"), Store(tmp_path / "w")
    with staged_store.staging() as staged:
        out, expected = _staged_output(staged)
        assert isinstance(out.arrays["a"], np.memmap)  # really in a file of the store
        art = staged_store.put(KEY, out, {"kind": "t"}, staged)
        assert list(staged.folder.iterdir()) == [staged.folder / "s2.npy"]  # c, not adopted
    assert not staged.folder.exists()
    plain = written_store.put(KEY, StageOutput(arrays=expected, meta={"m": 1}), {"kind": "t"})
    assert art._files == plain._files  # names, sizes, checksums, dtypes, shapes
    for name in ("a0.npy", "a1.npy", "a2.npy", "a3.npy"):
        assert (art.path / name).read_bytes() == (plain.path / name).read_bytes()
    Store._verified.clear()  # a new process checks the checksums against the bytes
    assert staged_store.check(KEY) == ("hit", "")
    for name, want in expected.items():
        np.testing.assert_array_equal(art.array(name), want)


def test_a_failed_part_leaves_no_staged_file(store: Store) -> None:
    with pytest.raises(RuntimeError), store.staging() as staged:
        staged.empty((1000,), np.float64)[:] = 1.0
        raise RuntimeError("the stage failed")
    assert list((store.root / "tmp").iterdir()) == []
    assert store.check(KEY)[0] == "miss"


def test_a_full_cache_disk_is_a_clear_error_before_anything_is_written(
    mappable_tmp: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Writing through a mapping into blocks the disk does not have kills the process
    # (SIGBUS): the blocks are reserved first, and a full disk says so.
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    with store.staging() as staged:
        with pytest.raises(StoreError, match="no space left in the cache folder") as err:
            staged.empty((1000,), np.float64)
        assert "cache.root" in (err.value.fix or "")
        assert list(staged.folder.iterdir()) == []


@pytest.mark.skipif(
    sys.platform != "linux" or tuple(map(int, os.uname().release.split(".")[:2])) < (5, 14),
    reason="MADV_POPULATE_WRITE is Linux 5.14+",
)
def test_staged_pages_are_mapped_in_at_once_through_ctypes(mappable_tmp: Path) -> None:
    tmp_path = mappable_tmp
    from gridsolve.stages.engine.store import Staging, _populate

    (tmp_path / "s").mkdir()
    arr = Staging(tmp_path / "s").empty((64, 1024), np.float64)
    assert isinstance(arr, np.memmap)
    assert _populate(arr)  # page-aligned start and length: the kernel took it
    # ctypes lets other threads run during the call (mmap.madvise holds the GIL)
    import ctypes

    from gridsolve.stages.engine.store import _madvise

    assert isinstance(_madvise(), ctypes._CFuncPtr)
    arr[...] = 1.5
    assert float(arr.sum()) == 1.5 * arr.size


def test_only_the_very_array_staged_is_adopted(mappable_tmp: Path, store: Store) -> None:
    pair = np.dtype([("a", "<f4"), ("b", "<f4")])
    other = np.dtype([("x", "<i4"), ("y", "<i4")])  # the same size: '|V8' both
    with store.staging() as staged:
        a = staged.empty((3, 4), pair)
        a[...] = 0
        b = staged.empty((5,), np.float64)
        b[...] = 1.0
        assert staged.adopt(a.view(other)) is None  # another dtype: np.save's header differs
        assert staged.adopt(b[1:]) is None  # part of it
        assert staged.adopt(b.reshape(5, 1)) is None  # another shape
        assert staged.adopt(np.ones(5)) is None  # made in memory
        found = staged.adopt(b)
        assert found is not None and found[1] == found[0].stat().st_size
        assert staged.adopt(b) is None  # once
        c = staged.empty((5,), np.float64)  # a name of its own after an adoption
        assert c.filename != b.filename


def _fallocate_unsupported(fd: int, offset: int, length: int) -> None:
    raise OSError(95, "Operation not supported")


@pytest.mark.parametrize("why", ["no fallocate", "fallocate refused", "other file system"])
def test_where_files_cannot_be_filled_through_a_mapping_outputs_are_written_as_before(
    mappable_tmp: Path, store: Store, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    # macOS has no posix_fallocate; NFS, ZFS may not reserve blocks, where writing
    # through a mapping could fail unseen or kill the process
    from gridsolve.stages.engine import store as store_module

    if why == "no fallocate":
        monkeypatch.delattr(os, "posix_fallocate", raising=False)
    elif why == "fallocate refused":
        monkeypatch.setattr(os, "posix_fallocate", _fallocate_unsupported, raising=False)
    else:
        monkeypatch.setattr(store_module, "_RESERVING_FILE_SYSTEMS", frozenset())
    with store.staging() as staged:
        a = staged.empty((4, 5), np.float32)
        assert not isinstance(a, np.memmap)
        a[...] = 3.0
        art = store.put(KEY, StageOutput(arrays={"a": a}, meta={}), {}, staged)
    np.testing.assert_array_equal(art.array("a"), np.full((4, 5), 3.0, np.float32))


def test_staged_arrays_filled_by_writes_of_rows_store_the_same_bytes(
    mappable_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Filling by file writes (no page mapped in first) instead of through the mapping.
    import gridsolve.stages.engine.store as store_module

    populated: list[int] = []
    populate = store_module._populate
    monkeypatch.setattr(
        store_module, "_populate", lambda arr: populated.append(arr.size) or populate(arr)
    )
    writes: list[int] = []
    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, b, o: writes.append(o) or pwrite(fd, b, o))
    want = np.arange(3 * 4 * 50, dtype=np.float32).reshape(3, 4, 50) / 7
    staged_store, written_store = Store(mappable_tmp / "s"), Store(mappable_tmp / "w")
    with staged_store.staging() as staged:
        a = staged.empty((3, 4, 5, 10), np.float32, populate=False)
        flat = a.reshape(3, 4, 50)  # a view, as the model's pixel-last arrays are
        for i in range(3):
            for j in range(4):
                staged.write(flat, (i, j), want[i, j])
        staged.write(flat, (2,), want[2])  # a bigger block, again
        assert np.array_equal(a.reshape(3, 4, 50), want)  # the mapping sees the writes
        kept = np.empty((2, 3), np.float64)  # not staged: assigned
        staged.write(kept, (1,), np.array([1.0, 2.0, 3.0]))
        assert kept[1].tolist() == [1.0, 2.0, 3.0]
        art = staged_store.put(KEY, StageOutput(arrays={"a": a}, meta={}), {"kind": "t"}, staged)
    assert populated == []
    assert len(writes) == 13 and writes[0] == writes[-1] - 2 * 4 * 50 * 4  # at the rows' offsets
    plain = written_store.put(
        KEY, StageOutput(arrays={"a": want.reshape(3, 4, 5, 10)}, meta={}), {"kind": "t"}
    )
    assert art._files == plain._files
    assert (art.path / "a0.npy").read_bytes() == (plain.path / "a0.npy").read_bytes()


def test_a_full_disk_during_a_staged_write_is_a_clear_error(
    mappable_tmp: Path, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(28, "No space left on device")

    with store.staging() as staged:
        a = staged.empty((4, 100), np.float32, populate=False)
        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(StoreError, match="no space left in the cache folder"):
            staged.write(a, (1,), np.ones(100, np.float32))
