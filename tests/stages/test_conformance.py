"""One conformance suite per stage kind, run over every registered implementation.

Each implementation of a kind is swapped into a small seeded pipeline (4
coefficients, gaps, two tiles) and run through the same plan as the flow; the
runner enforces the kind's contract (stages/<kind>/contract.py) on every
output, and each kind's test checks its outputs against an independent oracle.
Built-in implementations and the test plugins (tests/plugins/my_stage.py,
my_solve.py) are
collected alike; an implementation that is not constructible from defaults
needs an entry in EXAMPLES.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import my_solve
import numpy as np
import pytest
import torch
import xarray as xr

from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.contract import contracts
from gridsolve.stages.engine.registry import implementations

import my_models
import my_stage
from testkit import make_ds, run_plan

#: Configs of implementations that defaults cannot build, or that must give 4 coefficients.
EXAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("design", "polynomial"): {"degree": 3},
    ("design", "harmonic"): {"harmonics": 1},
    ("design", "random"): {"coef": 4},
    ("design", "legendre"): {"degree": 3},
    ("design", "variable"): {},
    ("solve", "lstsq"): {"dtype": "float64"},  # some designs here are beyond float32 (κ > 1e4)
    # a line in the observation index: lstsq of [1, index] is its oracle
    ("solve", "curvefit"): {
        "target": "my_curves:line",
        "params": ["a", "b"],
        "p0": {"a": 0.0, "b": 0.0},
        "t": "index",
    },
    ("model", "module"): {"target": "my_models:TinyMLP", "kwargs": {"n_in": 4}, "input_shape": [4]},
    ("model", "multidim_linear"): {"input_dim": 2, "hidden_dim": 2, "output_dim": 3},
}


def _impls(kind: str) -> list[str]:
    with _plugin():
        return sorted(implementations(kind))


class _plugin:
    """The test plugin registered for the duration (left as found)."""

    def __enter__(self) -> None:
        self.design = "legendre" not in implementations("design")
        self.solve = "numpy_lstsq" not in implementations("solve")
        my_stage.install()
        my_solve.install()

    def __exit__(self, *exc: object) -> None:
        if self.design:
            my_stage.uninstall()
        if self.solve:
            my_solve.uninstall()


@pytest.fixture(autouse=True)
def plugin() -> Iterator[None]:
    with _plugin():
        yield


@pytest.fixture
def cube(tmp_path: Path) -> Path:
    ds = make_ds(n_obs=16, ny=6, nx=7, nan_fraction=0.1, seed=3)
    n = ds.sizes["time"]
    t = np.linspace(-1, 1, n)
    ds["A"] = (("time", "col"), np.stack([np.ones(n), t, t**2, np.cos(3 * t)], axis=1))
    ds = ds.assign_coords(col=["one", "t", "t2", "cos3t"])
    sig = np.nan_to_num(ds["signal"].values)
    ds["tgt"] = (("out", "y", "x"), np.stack([sig.mean(axis=0) - 2, sig[0] - 2, sig[1] - 2]))
    path = tmp_path / "cube.nc"
    ds.to_netcdf(path)
    return path


def _config(tmp_path: Path, cube: Path, kind: str, impl: str) -> dict[str, Any]:
    """A small pipeline with ``kind`` implemented by ``impl``, the rest by defaults."""
    load = {"path": str(cube), "variable": "signal", "design": "A"}
    sections: dict[str, Any] = {
        "load": load,
        "design": {"impl": "polynomial", **EXAMPLES[("design", "polynomial")]},
        "solve": {"impl": "lstsq", **EXAMPLES[("solve", "lstsq")]},
        "model": {"impl": "multidim_linear", **EXAMPLES[("model", "multidim_linear")]},
        "write": {"path": str(tmp_path / "out.nc")},
        "cache": {"root": str(tmp_path / "cache")},
    }
    section = {"impl": impl, **EXAMPLES.get((kind, impl), {})}
    if kind == "load":
        section.update(load if impl != "demo" else {})
    if kind == "write":
        section["path"] = str(tmp_path / "out.nc")
    sections[kind] = section
    if kind == "train" and impl != "none":
        load["target"] = "tgt"
        section.update(epochs=5, batch_pixels=8, lr=0.02, validation_fraction=0.0)
    if (kind, impl) == ("load", "demo"):
        sections["design"] = {"impl": "random", "coef": 4}
    if (kind, impl) in (("solve", "curvefit"), ("design", "none"), ("normal_equations", "none")):
        # a nonlinear fit: no design, no normal equations, no model (it writes no coefficients)
        for k in ("design", "normal_equations", "model"):
            sections.pop(k, None)
        load.pop("design")
        sections["solve"] = {"impl": "curvefit", **EXAMPLES[("solve", "curvefit")]}
        sections[kind] = {**sections.get(kind, {}), **section} if kind != "solve" else section
    return sections


def _run(tmp_path: Path, cube: Path, ctx: Any, kind: str, impl: str) -> tuple[Any, dict[str, Any]]:
    cfg = build_config(_config(tmp_path, cube, kind, impl))
    return cfg, run_plan(cfg.stage_configs(), ctx, tile_pixels=24)


def test_every_kind_has_a_contract() -> None:
    assert set(contracts()) == {
        "load",
        "design",
        "normal_equations",
        "solve",
        "train",
        "model",
        "write",
    }


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.parametrize("impl", _impls("load"))
def test_load(impl: str, tmp_path: Path, cube: Path, ctx: Any) -> None:
    _, refs = _run(tmp_path, cube, ctx, "load", impl)
    meta = refs["load"].meta
    art = ctx.store.get(refs["load"].key)
    src = Path(meta["source"]["path"]) if "source" in meta else cube
    with xr.open_dataset(src) as ds:
        da = ds[meta["variable"]]
        assert (meta["n_obs"], meta["ny"], meta["nx"]) == tuple(
            da.sizes[d] for d in (meta["obs_dim"], meta["y_dim"], meta["x_dim"])
        )
        np.testing.assert_array_equal(art.array("y"), ds[meta["y_dim"]].values)
    # the same content gives the same key
    _, again = _run(tmp_path, cube, ctx, "load", impl)
    assert again["load"].key == refs["load"].key


@pytest.mark.parametrize("impl", _impls("design"))
def test_design(impl: str, tmp_path: Path, cube: Path, ctx: Any) -> None:
    _, refs = _run(tmp_path, cube, ctx, "design", impl)
    if impl == "none":
        assert "design" not in refs and "write" in refs
        return
    A = np.asarray(ctx.store.get(refs["design"].key).array("A"))
    meta = refs["design"].meta
    assert A.shape == (refs["load"].meta["n_obs"], meta["coef"]) == (16, 4)
    assert meta["rank"] == np.linalg.matrix_rank(A)
    assert len(meta["columns"]) == meta["coef"]


@pytest.mark.parametrize("impl", _impls("normal_equations"))
def test_normal_equations(impl: str, tmp_path: Path, cube: Path, ctx: Any) -> None:
    _, refs = _run(tmp_path, cube, ctx, "normal_equations", impl)
    if impl == "none":
        assert "normal_equations" not in refs and "write" in refs
        return
    ne = ctx.store.get(refs["normal_equations"].key)
    A = np.asarray(ctx.store.get(refs["design"].key).array("A"))
    U, s, Vt, sqrtw = (np.asarray(ne.array(k)) for k in ("U", "s", "Vt", "sqrtw"))
    np.testing.assert_allclose((U * s) @ Vt, A * sqrtw[:, None], atol=1e-12)
    np.testing.assert_allclose(s, np.linalg.svd(A * sqrtw[:, None], compute_uv=False), rtol=1e-12)


def _assemble(ctx: Any, ref: Any, name: str) -> np.ndarray:
    blocks = [(t.tile, np.asarray(ctx.store.get(t.key).array(name))) for t in ref.tiles]
    ny = max(t.y1 for t, _ in blocks)
    nx = max(t.x1 for t, _ in blocks)
    out = np.full((*blocks[0][1].shape[:-2], ny, nx), np.nan)
    for t, b in blocks:
        out[..., t.y0 : t.y1, t.x0 : t.x1] = b
    return out


@pytest.mark.parametrize("impl", _impls("solve"))
def test_solve(impl: str, tmp_path: Path, cube: Path, ctx: Any) -> None:
    _, refs = _run(tmp_path, cube, ctx, "solve", impl)
    assert len(refs["solve"].tiles) > 1
    with xr.open_dataset(cube) as ds:
        data = ds["signal"].values
    if impl == "curvefit":  # a line in the index
        coef = _assemble(ctx, refs["solve"], "params")
        A = np.stack([np.ones(data.shape[0]), np.arange(data.shape[0])], axis=1)
    else:
        coef = _assemble(ctx, refs["solve"], "coefficients")
        A = np.asarray(ctx.store.get(refs["design"].key).array("A"))
    for j in range(data.shape[1]):
        for i in range(data.shape[2]):
            ok = np.isfinite(data[:, j, i])
            expected = np.linalg.lstsq(A[ok], data[ok, j, i], rcond=None)[0]
            np.testing.assert_allclose(coef[:, j, i], expected, rtol=2e-4, atol=2e-5)


#: What a run writes without a model: every variable comes from solve or design (no
#: prediction, model_status, grad_* or jac_*).
WITHOUT_MODEL = {
    "design",
    "coefficients",
    "residual_rms",
    "n_valid",
    "status",
    "coef_stderr",
    "t_value",
    "p_value",
    "dof",
    "r2",
    "uncertainty_flags",
    "trend",
    "trend_stderr",
    "trend_p_value",
}


@pytest.mark.parametrize("impl", _impls("model"))
def test_model(impl: str, tmp_path: Path, cube: Path, ctx: Any) -> None:
    if impl == "none":
        cfg = build_config(_config(tmp_path, cube, "model", impl))
        assert "model" not in run_plan(cfg.stage_configs(), ctx, tile_pixels=24)
        return
    cfg, refs = _run(tmp_path, cube, ctx, "model", impl)
    coef = _assemble(ctx, refs["solve"], "coefficients")
    pred = _assemble(ctx, refs["model"], "prediction")
    from gridsolve.stages.model.building import build_module, input_shape

    module = build_module(cfg.model)
    shape = input_shape(cfg.model)
    for j, i in [(0, 0), (2, 3), (5, 6)]:
        x = torch.from_numpy(coef[:, j, i].astype(np.float32)).reshape(shape)
        with torch.no_grad():
            expected = module(x).reshape(-1).numpy()
        np.testing.assert_allclose(pred[:, j, i], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", _impls("write"))
def test_write(impl: str, tmp_path: Path, cube: Path, ctx: Any) -> None:
    _, refs = _run(tmp_path, cube, ctx, "write", impl)
    out = Path(refs["write"].meta["path"])
    coef = _assemble(ctx, refs["solve"], "coefficients")
    with xr.open_zarr(out) if out.is_dir() else xr.open_dataset(out) as ds:  # file or store
        got = ds["coefficients"].values
        np.testing.assert_array_equal(got, coef.astype(got.dtype))


@pytest.mark.parametrize("impl", _impls("write"))
def test_write_without_a_model(impl: str, tmp_path: Path, cube: Path, ctx: Any) -> None:
    sections = _config(tmp_path, cube, "write", impl)
    del sections["model"]  # no section: no model
    sections["design"] = {"impl": "polynomial", "degree": 1}
    sections["load"].pop("design")
    sections["solve"]["uncertainty"] = "stderr"
    refs = run_plan(build_config(sections).stage_configs(), ctx, tile_pixels=24)
    assert "model" not in refs
    out = Path(refs["write"].meta["path"])
    with xr.open_zarr(out) if out.is_dir() else xr.open_dataset(out) as ds:
        assert set(ds.data_vars) == WITHOUT_MODEL
        assert "output" not in ds.dims
        assert ds.attrs["title"] == "gridsolve per-pixel least squares"
        assert "model" not in json.loads(ds.attrs["gridsolve_config"])
        coef = _assemble(ctx, refs["solve"], "coefficients")
        np.testing.assert_array_equal(
            ds["coefficients"].values, coef.astype(ds["coefficients"].dtype)
        )


@pytest.mark.parametrize("impl", _impls("train"))
def test_train(impl: str, tmp_path: Path, cube: Path, ctx: Any) -> None:
    if impl == "none":
        cfg = build_config(_config(tmp_path, cube, "train", impl))
        assert "train" not in run_plan(cfg.stage_configs(), ctx, tile_pixels=24)
        return
    cfg, refs = _run(tmp_path, cube, ctx, "train", impl)
    coef = _assemble(ctx, refs["solve"], "coefficients")
    status = _assemble(ctx, refs["solve"], "status")
    with xr.open_dataset(cube) as ds:
        target = ds["tgt"].values
    from gridsolve.stages.model.building import build_module, input_shape

    def mse(module: torch.nn.Module) -> float:
        errors = []
        for j, i in zip(*np.nonzero(status == 0), strict=True):
            x = torch.from_numpy(coef[:, j, i].astype(np.float32)).reshape(input_shape(cfg.model))
            with torch.no_grad():
                errors.append(
                    float(((module(x).reshape(-1).numpy() - target[:, j, i]) ** 2).mean())
                )
        return float(np.mean(errors))

    initial = build_module(cfg.model)
    trained = build_module(cfg.model)
    weights = ctx.store.get(refs["train"].key)
    trained.load_state_dict(
        {
            k: torch.from_numpy(np.array(weights.array(f"param:{k}")))
            for k, _ in trained.named_parameters()
        }
    )
    assert mse(trained) < 0.9 * mse(initial)  # it learnt
    history = refs["train"].meta["history"]
    assert len(history) == 5
    # the last epoch's mean loss is the mse of the weights during that epoch: near the final one
    assert abs(history[-1]["train_loss"] - mse(trained)) < 0.5 * history[0]["train_loss"]


def test_the_suite_covers_plugins() -> None:
    assert "legendre" in _impls("design")
    assert "numpy_lstsq" in _impls("solve")
    assert my_models.TinyMLP is not None
