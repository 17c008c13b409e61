"""The input's digest, remembered across runs while the file is unchanged (stages/load/scanmemo.py).

A rerun whose every stage hits finds the load key without opening the input; any
change to the file (content, a restored mtime, a replacement) is scanned again, and a
file changed within the timestamp resolution of its scan is never remembered.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from gridsolve.schemas.errors import InputError
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.stages.load import reading, scanmemo
from gridsolve.stages.load.netcdf import fingerprint, locate

from testkit import make_ds


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the load stage scanned (opened and hashed), in order."""
    seen: list[str] = []
    real = reading.scan_file

    def counting(nc: NetCDFLoad, path: str) -> Any:
        seen.append(path)
        return real(nc, path)

    monkeypatch.setattr(reading, "scan_file", counting)
    return seen


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written by the test count as settled (they are younger than the racy window)."""
    monkeypatch.setattr(scanmemo, "RACY_NS", -1)


def entries(ctx: Any) -> list[Path]:
    return sorted((Path(ctx.store.root) / "scan-digests").glob("*.json"))


@pytest.mark.usefixtures("settled")
def test_an_unchanged_file_is_scanned_once(ctx: Any, cube_path: Path, scans: list[str]) -> None:
    cfg = NetCDFLoad(path=str(cube_path))
    first = fingerprint(cfg, ctx)["content"]
    assert scans == [str(cube_path)] and len(entries(ctx)) == 1
    assert fingerprint(cfg, ctx)["content"] == first
    where = locate(cfg, ctx)
    assert (where["content"], where["path"]) == (first, str(cube_path))
    assert where["file"]["size"] == cube_path.stat().st_size
    assert scans == [str(cube_path)]  # neither the second key nor locate opened it


@pytest.mark.usefixtures("settled")
def test_a_rewritten_file_is_scanned_again_even_with_its_mtime_restored(
    ctx: Any, cube_path: Path, scans: list[str]
) -> None:
    cfg = NetCDFLoad(path=str(cube_path))
    before = fingerprint(cfg, ctx)["content"]
    st = cube_path.stat()
    ds = make_ds()
    ds["signal"][3, 2, 1] += 1.0  # same size, other content
    ds.to_netcdf(cube_path)
    os.utime(cube_path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p` or `touch -r` would
    assert cube_path.stat().st_size == st.st_size
    after = fingerprint(cfg, ctx)["content"]
    assert after != before
    assert scans == [str(cube_path)] * 2


@pytest.mark.usefixtures("settled")
def test_a_replaced_file_and_a_copy_are_scanned(
    ctx: Any, tmp_path: Path, cube_path: Path, scans: list[str]
) -> None:
    key = fingerprint(NetCDFLoad(path=str(cube_path)), ctx)["content"]
    copy = tmp_path / "copy.nc"
    shutil.copy2(cube_path, copy)  # the same content elsewhere: same key, its own scan
    assert fingerprint(NetCDFLoad(path=str(copy)), ctx)["content"] == key
    os.replace(copy, cube_path)  # same bytes under the old name, another inode
    assert fingerprint(NetCDFLoad(path=str(cube_path)), ctx)["content"] == key
    assert scans == [str(cube_path), str(copy), str(cube_path)]


def test_a_file_younger_than_the_racy_window_is_not_remembered(
    ctx: Any, cube_path: Path, scans: list[str]
) -> None:
    cfg = NetCDFLoad(path=str(cube_path))
    fingerprint(cfg, ctx)
    assert entries(ctx) == []  # written just now: its identity could repeat after a change
    fingerprint(cfg, ctx)
    assert len(scans) == 2


@pytest.mark.usefixtures("settled")
def test_a_refused_file_is_never_remembered(ctx: Any, tmp_path: Path, scans: list[str]) -> None:
    bad = tmp_path / "bad.nc"
    bad.write_bytes(b"not a NetCDF file at all")
    for _ in range(2):
        with pytest.raises(InputError, match="is not NetCDF"):
            fingerprint(NetCDFLoad(path=str(bad)), ctx)
    assert entries(ctx) == []
    assert scans == [str(bad)] * 2  # refused each time, not passed on a remembered digest


@pytest.mark.usefixtures("settled")
def test_the_settings_are_part_of_the_entry(ctx: Any, cube_path: Path, scans: list[str]) -> None:
    whole = fingerprint(NetCDFLoad(path=str(cube_path)), ctx)["content"]
    part = fingerprint(NetCDFLoad(path=str(cube_path), isel={"x": [0, 1]}), ctx)["content"]
    assert part != whole
    assert len(entries(ctx)) == 2 and len(scans) == 2


@pytest.mark.usefixtures("settled")
def test_an_unreadable_entry_costs_a_scan(ctx: Any, cube_path: Path, scans: list[str]) -> None:
    cfg = NetCDFLoad(path=str(cube_path))
    key = fingerprint(cfg, ctx)["content"]
    (entry,) = entries(ctx)
    entry.write_text("{not json")
    assert fingerprint(cfg, ctx)["content"] == key
    assert len(scans) == 2


def test_racy_is_judged_from_when_the_scan_began(
    ctx: Any, cube_path: Path, scans: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a file written just before a long scan is still racy when the scan ends: what counts
    # is the time its identity was taken, not the time the digest is recorded
    real = reading.scan_file

    def slow(nc: NetCDFLoad, path: str) -> Any:
        got = real(nc, path)
        later = got.began_ns + 10 * scanmemo.RACY_NS  # the scan took 20 s
        monkeypatch.setattr(time, "time_ns", lambda: later)
        return got

    monkeypatch.setattr(reading, "scan_file", slow)
    fingerprint(NetCDFLoad(path=str(cube_path)), ctx)
    assert entries(ctx) == []
