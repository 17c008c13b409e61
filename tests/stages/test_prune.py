"""The cache's size cap without Prefect: last use, leases across processes, LRU eviction."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gridsolve.schemas.execution import CacheConfig
from gridsolve.schemas.kinds.write import NetCDFWrite, ZarrWrite
from gridsolve.stages.engine import leases
from gridsolve.stages.engine.prune import _evict, prune, usage
from gridsolve.stages.engine.store import MANIFEST, StageOutput, Store

REPO = Path(__file__).resolve().parents[2]


def fill(store: Store, n: int, nbytes: int = 4000) -> list[str]:
    """``n`` artifacts of ``nbytes`` of seeded data each, last used in key order, an hour ago."""
    keys = []
    rng = np.random.default_rng(0)
    base = time.time() - 3600
    for i in range(n):
        key = f"{i:02d}" + "ab" * 15
        store.put(key, StageOutput(arrays={"x": rng.random(nbytes // 8)}), {"kind": "test"})
        os.utime(store.path(key) / MANIFEST, (base + i, base + i))
        keys.append(key)
    return keys


def size_of(store: Store, key: str) -> int:
    return sum(p.stat().st_size for p in store.path(key).iterdir())


def remaining(store: Store) -> list[str]:
    return sorted(e.key for e in usage(store.root).artifacts)


@pytest.fixture
def holder(store: Store) -> Iterator[subprocess.Popen[str]]:
    """A child process holding a lease on ``store``; it reads the keys sent on its stdin."""
    code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from gridsolve.stages.engine import leases
        from gridsolve.stages.engine.store import Store
        root = Path({str(store.root)!r})
        lease = leases.acquire(root, "run")
        print(lease.path, flush=True)
        store = Store(root)
        for line in sys.stdin:
            store.get(line.strip())  # a run reading an artifact
            print("read", flush=True)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_hit_stamps_last_use_and_put_counts_as_one(store: Store) -> None:
    (key,) = fill(store, 1)
    before = (store.path(key) / MANIFEST).stat().st_mtime
    assert before < time.time() - 3000
    assert store.check(key) == ("hit", "")
    after = (store.path(key) / MANIFEST).stat().st_mtime
    assert after > time.time() - 60
    # the arrays themselves are untouched: the verified-checksum memo still holds
    assert store.get(key).array("x").shape == (500,)


def test_prune_removes_least_recently_used_first_until_under_the_cap(store: Store) -> None:
    keys = fill(store, 5)
    total = usage(store.root).total_bytes
    assert total == sum(size_of(store, k) for k in keys)
    # a hit makes the oldest the most recently used one
    assert store.check(keys[0])[0] == "hit"
    freed = size_of(store, keys[1]) + size_of(store, keys[2])
    cap = total - size_of(store, keys[1]) - size_of(store, keys[2]) // 2
    records = store.root / "prefect"
    records.mkdir()
    for key in keys:
        (records / key).write_text("{}")  # Prefect's cache record of the key
    report = prune(store.root, cap)
    assert [e.key for e in report.removed] == [keys[1], keys[2]]  # LRU order, no more
    assert report.freed_bytes == freed and report.after_bytes == total - freed <= cap
    assert remaining(store) == sorted([keys[0], keys[3], keys[4]])
    assert store.check(keys[1]) == ("miss", "")
    # the removed artifacts' Prefect records go with them; the pruner's lease is gone
    assert sorted(p.name for p in records.iterdir()) == sorted([keys[0], keys[3], keys[4]])
    assert not list((store.root / leases.LEASES).glob("*.json"))


def test_dry_run_removes_nothing(store: Store) -> None:
    keys = fill(store, 3)
    report = prune(store.root, 0, dry_run=True)
    assert [e.key for e in report.removed] == keys
    assert report.lines()[0].startswith("would remove " + keys[0][:16])
    assert remaining(store) == keys
    assert not (store.root / leases.LEASES).exists() or not any(
        (store.root / leases.LEASES).iterdir()
    )


def test_a_live_lease_in_another_process_protects_what_it_used_until_it_dies(
    store: Store, holder: subprocess.Popen[str]
) -> None:
    keys = fill(store, 5)
    assert holder.stdin is not None and holder.stdout is not None
    lease_path = Path(holder.stdout.readline().strip())
    record = json.loads(lease_path.read_text())
    assert record["pid"] == holder.pid and record["host"] == socket.gethostname()
    assert record["pid_start"]  # from /proc (or psutil): a reused pid is not this one
    for key in keys[3:]:  # the run reads two of the five artifacts
        holder.stdin.write(key + "\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "read"

    scan = leases.scan(store.root)
    assert [lease.pid for lease in scan.live] == [holder.pid]
    report = prune(store.root, 0)
    assert [e.key for e in report.removed] == keys[:3]
    assert report.in_use == 2 and report.runs == 1
    assert any("still over the cap" in line for line in report.lines())
    assert remaining(store) == keys[3:]

    holder.send_signal(signal.SIGKILL)  # dies without removing its lease
    holder.wait()
    assert lease_path.exists()
    assert leases.scan(store.root).expired == [lease_path]
    report = prune(store.root, 0)
    assert [e.key for e in report.removed] == keys[3:]
    assert report.swept_leases == 1 and not lease_path.exists()
    assert remaining(store) == [] and report.after_bytes == 0


def test_a_reused_pid_or_a_stale_foreign_lease_is_expired(store: Store) -> None:
    folder = store.root / leases.LEASES
    folder.mkdir()
    me = os.getpid()
    mine = leases.process_start(me)
    assert mine is not None
    reused = folder / "reused.json"
    reused.write_text(
        json.dumps({"host": socket.gethostname(), "pid": me, "pid_start": mine + "0"})
    )
    alive = folder / "alive.json"
    alive.write_text(json.dumps({"host": socket.gethostname(), "pid": me, "pid_start": mine}))
    fresh = folder / "foreign-fresh.json"
    fresh.write_text(json.dumps({"host": "elsewhere.invalid", "pid": 1, "pid_start": None}))
    stale = folder / "foreign-stale.json"
    stale.write_text(json.dumps({"host": "elsewhere.invalid", "pid": 1, "pid_start": None}))
    old = time.time() - leases.FOREIGN_TIMEOUT_S - 60
    os.utime(stale, (old, old))
    garbled = folder / "garbled.json"
    garbled.write_text("{not json")
    os.utime(garbled, (old, old))
    scan = leases.scan(store.root, sweep=True)
    assert sorted(lease.path.name for lease in scan.live) == ["alive.json", "foreign-fresh.json"]
    assert sorted(p.name for p in scan.expired) == [
        "foreign-stale.json",
        "garbled.json",
        "reused.json",
    ]
    assert sorted(p.name for p in folder.iterdir()) == ["alive.json", "foreign-fresh.json"]


def test_an_artifact_used_during_its_eviction_is_put_back(store: Store) -> None:
    (key,) = fill(store, 1)
    entry = usage(store.root).artifacts[0]
    assert store.check(key)[0] == "hit"  # used after the pruner looked
    cutoff = time.time_ns() - 10**9
    assert _evict(store.root, entry, cutoff) is False
    assert store.check(key) == ("hit", "")
    assert not [p for p in (store.root / "tmp").iterdir()]


def test_quarantined_folders_go_first(store: Store) -> None:
    keys = fill(store, 2)
    (store.path(keys[1]) / "a0.npy").write_bytes(b"garbage")
    assert store.lookup(keys[1])[0] == "corrupt"  # moved aside to corrupt/
    used = usage(store.root)
    assert len(used.quarantined) == 1 and [e.key for e in used.artifacts] == [keys[0]]
    report = prune(store.root, used.artifact_bytes)
    assert [(e.key, e.quarantined) for e in report.removed] == [(keys[1], True)]
    assert remaining(store) == [keys[0]] and not any((store.root / "corrupt").iterdir())


def test_the_size_cap_and_keep_last_are_in_no_key() -> None:
    assert CacheConfig(max_size="20GiB").max_size_bytes == 20 * 2**30
    assert CacheConfig(max_size=1000).max_size_bytes == 1000
    assert CacheConfig().max_size_bytes is None
    with pytest.raises(ValueError, match="not a size"):
        CacheConfig(max_size="lots")
    for cls in (NetCDFWrite, ZarrWrite):
        plain = cls(path="out-{flow_run_name}")
        kept = cls(path="out-{flow_run_name}", keep_last=3)
        assert "keep_last" in cls.speed_fields()
        assert plain.key_payload() == kept.key_payload()
        with pytest.raises(ValueError):
            cls(path="x", keep_last=0)
