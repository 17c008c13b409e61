"""Data contracts: the dims, dtypes and shapes a stage takes and returns.

Checks collect every violation and raise one :class:`ContractError` that lists
them all with what was expected and what was found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gridsolve.schemas.errors import ContractError

_KIND_NAMES = {"f": "float", "i": "signed int", "u": "unsigned int", "b": "bool"}


@dataclass(frozen=True)
class ArraySpec:
    """Contract of one array: named dims (sizes bound across arrays) and dtype kinds."""

    dims: tuple[str, ...]
    kinds: str = "f"
    description: str = ""

    def describe(self) -> str:
        """e.g. ``(coef, y, x) float``."""
        kinds = "/".join(_KIND_NAMES.get(k, k) for k in self.kinds)
        return f"({', '.join(self.dims)}) {kinds}"


def array_violations(
    arrays: Mapping[str, np.ndarray],
    specs: Mapping[str, ArraySpec],
    sizes: Mapping[str, int] | None = None,
) -> list[str]:
    """Every way ``arrays`` break ``specs``; dim sizes must agree with ``sizes`` and each other."""
    bound = dict(sizes or {})
    problems: list[str] = []
    for name, spec in specs.items():
        if name not in arrays:
            problems.append(f"{name}: missing (expected {spec.describe()})")
            continue
        arr = arrays[name]
        if arr.ndim != len(spec.dims):
            problems.append(
                f"{name}: expected {len(spec.dims)} dims {spec.describe()}, found shape {arr.shape}"
            )
            continue
        if arr.dtype.kind not in spec.kinds:
            problems.append(f"{name}: expected dtype {spec.describe()}, found {arr.dtype}")
        for dim, size in zip(spec.dims, arr.shape, strict=True):
            if dim in bound and bound[dim] != size:
                problems.append(f"{name}: dim {dim!r} has size {size}, expected {bound[dim]}")
            else:
                bound.setdefault(dim, size)
    return problems


def check_arrays(
    stage: str,
    arrays: Mapping[str, np.ndarray],
    specs: Mapping[str, ArraySpec],
    sizes: Mapping[str, int] | None = None,
    *,
    what: str = "output",
) -> None:
    """Raise one ContractError listing every violation of ``specs``; return if none."""
    problems = array_violations(arrays, specs, sizes)
    if problems:
        raise ContractError(
            f"{what} breaks the stage contract ({len(problems)} problem(s))",
            stage=stage,
            violations=problems,
            fix="this is a bug in the stage implementation; report it with the config",
        )


def numeric_kind(dtype: np.dtype) -> bool:
    """Whether a dtype holds numbers gridsolve can compute with."""
    return dtype.kind in "fiu"


#: Per-pixel ``status`` codes of the solve stage (CF flag_values / flag_meanings).
#: ``underdetermined``: the pixel's valid rows (weight > 0) have numerical rank < coef,
#: so they do not determine every coefficient; the coefficients are what the policy
#: computed (minimum norm, ridge), the values derived from undetermined ones are NaN.
STATUS_FLAGS: dict[int, str] = {
    0: "ok",
    1: "all_missing",
    2: "too_few_observations",
    3: "fell_back_to_ridge",
    4: "fell_back_to_minimum_norm",
    5: "singular",
    6: "underdetermined",
}
STATUS_CODES: dict[str, int] = {v: k for k, v in STATUS_FLAGS.items()}

#: Per-pixel ``model_status`` codes of the model stage (CF flag_values / flag_meanings).
#: ``input_not_finite``: the coefficients are not finite (the solve status is not ok,
#: 3, 4 or 6): every model output is NaN. An ``underdetermined`` pixel keeps the finite
#: coefficients its policy computed (minimum norm, ridge), so the model runs on them.
#: ``target_not_finite``: the MSE target has a NaN/inf value: prediction and
#: Jacobians are computed, gradients are NaN.
#: ``output_not_finite``: inputs are finite but a prediction, gradient or Jacobian
#: value is not (overflow, log of a negative, …): the values are kept as computed.
MODEL_STATUS_FLAGS: dict[int, str] = {
    0: "ok",
    1: "input_not_finite",
    2: "target_not_finite",
    3: "output_not_finite",
}
MODEL_STATUS_CODES: dict[str, int] = {v: k for k, v in MODEL_STATUS_FLAGS.items()}


def flag_counts(status: np.ndarray, flags: dict[int, str]) -> dict[str, int]:
    """How many pixels carry each flag that occurs in ``status`` (int8 codes), by code.

    The codes in use are non-negative, so the counts come in code order.
    """
    # bincount, not np.unique: no sort of the pixels (1.4 → 0.2 ms for 250,000)
    counts = np.bincount(np.ascontiguousarray(status, np.int8).ravel().view(np.uint8))
    return {flags[k if k < 128 else k - 256]: int(c) for k, c in enumerate(counts) if c}
