"""Compute solve + model outputs of seeded cubes under this process's BLAS settings.

Run as a subprocess by tests/stages/test_determinism.py, once per emulated CPU
branch (``MKL_CBWR``) and thread count: ``python determinism_worker.py OUT.npz
THREADS``. Every case is computed under two tilings (one tile; uneven tiles)
and saved, so the test can compare across branches, threads and tilings.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _cases() -> list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    from gridsolve.schemas.kinds.design import HarmonicDesign, RandomDesign
    from gridsolve.schemas.kinds.solve import LstsqSolve

    return [
        # dense float32 cube, shared operator, coef > obs (minimum norm)
        (
            "dense32",
            {"n_obs": 8, "ny": 23, "nx": 37, "nan_fraction": 0.0, "dtype": "float32", "seed": 1},
            {"design": RandomDesign(coef=12), "model": (3, 4, 5)},
            {"solve": LstsqSolve(dtype="float32")},
        ),
        # gaps: shared, gap-pattern and per-pixel paths, float64
        (
            "gaps64",
            {"n_obs": 40, "ny": 29, "nx": 31, "nan_fraction": 0.2, "dtype": "float64", "seed": 2},
            {"design": HarmonicDesign(harmonics=2), "model": (3, 2, 4)},
            {"solve": LstsqSolve(dtype="float64")},
        ),
        # gaps, float32 data product, ridge
        (
            "gaps32ridge",
            {"n_obs": 30, "ny": 17, "nx": 41, "nan_fraction": 0.1, "dtype": "float32", "seed": 3},
            {"design": HarmonicDesign(harmonics=1), "model": (2, 2, 3)},
            {"solve": LstsqSolve(policy="ridge", ridge=1e-2)},
        ),
    ]


def _tilings(ny: int, nx: int) -> dict[str, list[Any]]:
    from gridsolve.schemas.artifacts import Tile

    uneven = []
    for y0, y1 in ((0, 5), (5, ny)):
        for x0, x1 in ((0, 7), (7, 20), (20, nx)):
            uneven.append(Tile(index=len(uneven), y0=y0, y1=y1, x0=x0, x1=x1))
    return {"one": [Tile(index=0, y0=0, y1=ny, x0=0, x1=nx)], "uneven": uneven}


def _testkit() -> tuple[Any, Any]:
    # Loaded by file: putting tests/ on sys.path would let tests/stages shadow the package.
    spec = importlib.util.spec_from_file_location(
        "testkit", Path(__file__).resolve().parents[1] / "testkit.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Chain, module.make_ds


def compute(out: Path) -> None:
    """Save every case's outputs under every tiling to ``out`` (npz)."""
    import gridsolve.stages  # noqa: F401
    from gridsolve.schemas.kinds.load import NetCDFLoad
    from gridsolve.schemas.kinds.model import MultidimLinearModel
    from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
    from gridsolve.stages.engine.context import StageContext
    from gridsolve.stages.engine.store import Store

    Chain, make_ds = _testkit()

    result: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cube, design, solve in _cases():
            path = Path(tmp) / f"{name}.nc"
            make_ds(**cube).to_netcdf(path)
            i, h, o = design["model"]
            model = MultidimLinearModel(input_dim=i, hidden_dim=h, output_dim=o, seed=7)
            for tiling, tiles in _tilings(cube["ny"], cube["nx"]).items():
                # A fresh store per tiling: every number is computed, none reused.
                store = Store(Path(tmp) / f"store-{name}-{tiling}")
                chain = Chain(StageContext(store=store, memory_budget=64 * 2**20))
                chain.whole("load", NetCDFLoad(path=str(path)))
                chain.whole("design", design["design"])
                chain.whole("normal_equations", SVDNormalEquations())
                solved = chain.tiled("solve", solve["solve"], tiles)
                modelled = chain.tiled("model", model, tiles)
                for arts in (solved, modelled):
                    for var in arts[0].names:
                        full: np.ndarray | None = None
                        for t, art in zip(tiles, arts, strict=True):
                            block = np.asarray(art.array(var))
                            if block.ndim < 2:
                                continue
                            if full is None:
                                shape = (*block.shape[:-2], cube["ny"], cube["nx"])
                                full = np.zeros(shape, dtype=block.dtype)
                            full[..., t.y0 : t.y1, t.x0 : t.x1] = block
                        if full is not None:
                            result[f"{name}/{tiling}/{var}"] = full
    np.savez(out, **result)


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[2]))
    compute(Path(sys.argv[1]))
