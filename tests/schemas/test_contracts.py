"""Helpers of the output contracts."""

from __future__ import annotations

import numpy as np
import pytest

from gridsolve.schemas.contracts import MODEL_STATUS_FLAGS, STATUS_FLAGS, flag_counts


@pytest.mark.parametrize("flags", [STATUS_FLAGS, MODEL_STATUS_FLAGS])
def test_flag_counts_equal_numpy_unique(flags: dict[int, str]) -> None:
    rng = np.random.default_rng(0)
    codes = np.array(sorted(flags), dtype=np.int8)
    status = rng.choice(codes[:-1], size=(37, 41)).astype(np.int8)  # the last code absent
    keys, counts = np.unique(status, return_counts=True)
    want = {flags[int(k)]: int(c) for k, c in zip(keys, counts, strict=True)}
    got = flag_counts(status, flags)
    assert got == want
    assert list(got) == list(want)  # in code order
    assert flags[int(codes[-1])] not in got


def test_flag_counts_of_negative_and_unknown_codes() -> None:
    flags = {-1: "filled", 0: "ok"}
    assert flag_counts(np.array([0, -1, -1], np.int8), flags) == {"ok": 1, "filled": 2}
    with pytest.raises(KeyError):
        flag_counts(np.array([7], np.int8), flags)
    assert flag_counts(np.array([], np.int8), flags) == {}
