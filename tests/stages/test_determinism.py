"""The reproducibility guarantee across emulated CPUs, thread counts and tilings.

Each run is a fresh process (tests/stages/determinism_worker.py) computing the
solve and model outputs of seeded cubes under one MKL code path
(``MKL_CBWR``: AUTO, AVX2, AVX512, COMPATIBLE) and one thread count, under two
tilings. Outputs are compared ACROSS branches, threads and tilings against the
stated bound (stages/engine/agreement.py), and a repeated run of one branch in
another process must be byte-identical. OpenBLAS (NumPy/SciPy factorisations)
keeps the kernel this machine sets; only its thread count varies.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from gridsolve.stages.engine.agreement import disagreements

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("determinism_worker.py")
BRANCHES = ("AUTO", "AVX2", "AVX512", "COMPATIBLE")
THREADS = (1, 2)


def _run(out: Path, branch: str, threads: int) -> dict[str, np.ndarray]:
    env = {
        **os.environ,
        "MKL_CBWR": branch,
        "MKL_NUM_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads),
        "OPENBLAS_NUM_THREADS": str(threads),
    }
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), str(threads)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as f:
        return dict(f)


def _split(result: dict[str, np.ndarray]) -> dict[tuple[str, str], dict[str, np.ndarray]]:
    """{(case, tiling): {variable: array}}."""
    groups: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for key, value in result.items():
        case, tiling, var = key.split("/")
        groups.setdefault((case, tiling), {})[var] = value
    return groups


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, np.ndarray]]:
    tmp = tmp_path_factory.mktemp("determinism")
    jobs = {f"{b}-{t}": (tmp / f"{b}-{t}.npz", b, t) for b in BRANCHES for t in THREADS}
    jobs["AUTO-1-again"] = (tmp / "again.npz", "AUTO", 1)
    # Two processes at a time: most of each run is importing torch, and which
    # processes overlap cannot change a result the guarantee covers.
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, *job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def test_the_matrix_computed_every_case(runs: dict[str, dict[str, np.ndarray]]) -> None:
    groups = _split(runs["AUTO-1"])
    assert {case for case, _ in groups} == {"dense32", "gaps64", "gaps32ridge"}
    for variables in groups.values():
        assert {"coefficients", "residual_rms", "status", "prediction", "grad:weight"} <= set(
            variables
        )
        assert np.isfinite(variables["coefficients"]).any()


def test_same_branch_and_tiling_is_byte_identical_across_processes(
    runs: dict[str, dict[str, np.ndarray]],
) -> None:
    first, again = runs["AUTO-1"], runs["AUTO-1-again"]
    assert first.keys() == again.keys()
    for key in first:
        assert first[key].tobytes() == again[key].tobytes(), key


@pytest.mark.parametrize("run", [f"{b}-{t}" for b in BRANCHES for t in THREADS])
def test_every_branch_thread_count_and_tiling_agrees_within_the_bound(
    runs: dict[str, dict[str, np.ndarray]], run: str
) -> None:
    reference = _split(runs["AUTO-1"])
    other = _split(runs[run])
    assert other.keys() == reference.keys()
    problems = []
    for (case, tiling), variables in other.items():
        # Compare each tiling against the reference's single tile: across tilings too.
        for p in disagreements(variables, reference[(case, "one")]):
            problems.append(f"{case}/{tiling}: {p}")
    assert not problems, "\n".join(problems)


def test_the_bound_is_not_vacuous(runs: dict[str, dict[str, np.ndarray]]) -> None:
    # A perturbation of a few hundred ulp must be caught: the bound is tight enough to matter.
    variables = _split(runs["AUTO-1"])[("dense32", "one")]
    coef = variables["coefficients"]
    bumped = {**variables, "coefficients": coef * np.float32(1 + 512 * np.finfo(np.float32).eps)}
    assert any(p.startswith("coefficients:") for p in disagreements(bumped, variables))
    assert not disagreements(dict(variables), variables)
