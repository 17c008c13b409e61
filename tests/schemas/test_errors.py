"""Errors render stage, expectation, finding and fix, and survive pickling (Dask, Prefect)."""

from __future__ import annotations

import pickle

from gridsolve.schemas.errors import ContractError, GridsolveError, NumericalError


def test_render_has_every_part() -> None:
    err = NumericalError(
        "cannot solve", stage="solve/lstsq", expected="full rank", found="rank 3", fix="use ridge"
    )
    text = str(err)
    assert text.splitlines()[0] == "numerical error: [solve/lstsq] cannot solve"
    assert (
        "expected: full rank" in text
        and "found:    rank 3" in text
        and "fix:      use ridge" in text
    )


def test_violations_are_all_listed_and_stage_is_added_once() -> None:
    err = ContractError("bad", violations=["a", "b"]).with_stage("load/netcdf")
    assert "[load/netcdf]" in str(err) and "  - a" in str(err) and "  - b" in str(err)
    err.with_stage("other")
    assert "[load/netcdf]" in str(err) and "other" not in str(err)


def test_pickle_round_trip_keeps_type_and_message() -> None:
    err = ContractError("bad", stage="s", violations=["x"], fix="f")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, ContractError) and isinstance(back, GridsolveError)
    assert str(back) == str(err)


def test_only_transient_failures_are_retried() -> None:
    from gridsolve.schemas.errors import ConfigError, InputError, StoreError, is_transient

    assert is_transient(StoreError("cache write failed", transient=True))
    assert is_transient(OSError("network file system hiccup"))
    assert not is_transient(InputError("input file not found"))
    assert not is_transient(ConfigError("bad"))
    assert not is_transient(ValueError("a bug"))
    back = pickle.loads(pickle.dumps(StoreError("x", transient=True)))
    assert back.transient
