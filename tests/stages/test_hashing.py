"""Content hashes: independent of chunking, path and mtime; sensitive to any value."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gridsolve.stages.engine.hashing import (
    ArrayHasher,
    canonical_json,
    file_digest,
    hash_array,
    stage_key,
    tile_key,
)


def test_canonical_json_ignores_key_order() -> None:
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == canonical_json(
        {"a": [1, {"c": 3, "d": 2}], "b": 1}
    )


def test_streamed_hash_does_not_depend_on_chunking() -> None:
    arr = np.random.default_rng(0).standard_normal((37, 11)).astype(np.float32)
    whole = ArrayHasher()
    whole.update(arr)
    parts = ArrayHasher()
    for i in range(0, 37, 5):
        parts.update(arr[i : i + 5])
    assert whole.hexdigest() == parts.hexdigest()


def test_array_hash_sees_one_value_dtype_and_shape() -> None:
    arr = np.arange(12.0)
    h = hash_array(arr)
    changed = arr.copy()
    changed[7] += 1e-12
    assert hash_array(changed) != h
    assert hash_array(arr.astype(np.float32)) != h
    assert hash_array(arr.reshape(3, 4)) != h
    assert hash_array(arr.copy()) == h


def test_datetime_arrays_hash() -> None:
    t = np.array(["2020-01-01", "2020-01-02"], dtype="datetime64[ns]")
    assert hash_array(t) != hash_array(t + np.timedelta64(1, "ns"))


def test_stage_key_chains_inputs_and_config() -> None:
    base = stage_key("solve", "lstsq", "1", {"policy": "minnorm"}, {"design": "a" * 32})
    assert len(base) == 32
    assert stage_key("solve", "lstsq", "1", {"policy": "minnorm"}, {"design": "b" * 32}) != base
    assert stage_key("solve", "lstsq", "2", {"policy": "minnorm"}, {"design": "a" * 32}) != base
    assert stage_key("solve", "lstsq", "1", {"policy": "ridge"}, {"design": "a" * 32}) != base
    assert tile_key(base, (0, 1, 0, 2)) != tile_key(base, (0, 1, 0, 3))


def test_file_digest_is_content_not_mtime(tmp_path: Path) -> None:
    a = tmp_path / "a.bin"
    b = tmp_path / "b.bin"
    a.write_bytes(b"x" * 1000)
    b.write_bytes(b"x" * 1000)
    os.utime(b, (1, 1))
    assert file_digest(a) == file_digest(b)
    b.write_bytes(b"x" * 999 + b"y")
    assert file_digest(a) != file_digest(b)
