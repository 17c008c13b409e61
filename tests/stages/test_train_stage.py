"""The train stage in the plan: its dataset, its key, and weights against an independent oracle."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.plan import build_plan
from gridsolve.stages.model.multidim_linear import MultidimLinear

from testkit import make_ds, run_plan


def cube_with_target(path: Path, ny: int = 18, nx: int = 14) -> Path:
    ds = make_ds(n_obs=12, ny=ny, nx=nx, seed=3, datetime_obs=False)
    sig = ds["signal"].values
    target = np.stack([sig.mean(axis=0) * 0.5 - 1.0, sig[0] - sig[-1]])
    ds["tgt"] = (("out", "y", "x"), target, {"units": "K"})
    ds.to_netcdf(path)
    return path


def sections(tmp_path: Path, cube: Path, **train: Any) -> dict[str, Any]:
    return {
        "load": {"path": str(cube), "variable": "signal", "target": "tgt"},
        "design": {"impl": "polynomial", "degree": 3, "scale": True},
        "solve": {"dtype": "float64"},
        "train": {"impl": "sgd", "epochs": 3, "lr": 0.05, "validation_fraction": 0.0, **train},
        "model": {
            "impl": "multidim_linear",
            "input_dim": 2,
            "hidden_dim": 2,
            "output_dim": 2,
            "dtype": "float64",
            "seed": 7,
        },
        "write": {"path": str(tmp_path / "out.nc")},
        "cache": {"root": str(tmp_path / "cache")},
    }


def run(tmp_path: Path, raw: dict[str, Any], ctx: Any, **kwargs: Any) -> dict[str, Any]:
    cfg = build_config(raw)
    return run_plan(cfg.stage_configs(), ctx, **kwargs)


def oracle_weights(cube: Path, epochs: int, lr: float, clip: float, momentum: float) -> Any:
    """Full-batch clipped SGD by a per-sample autograd loop on numpy lstsq coefficients."""
    import xarray as xr

    with xr.open_dataset(cube) as ds:
        y = ds["signal"].values
        target = ds["tgt"].values
        t = ds["time"].values.astype(np.float64)
    u = (t - (t.min() + t.max()) / 2) / ((t.max() - t.min()) / 2)
    A = np.stack([u**k for k in range(4)], axis=1)
    n_obs = y.shape[0]
    coef = np.linalg.lstsq(A, y.reshape(n_obs, -1), rcond=None)[0]  # (4, ny*nx)
    X = torch.from_numpy(coef.T.reshape(-1, 2, 2).copy())
    Y = torch.from_numpy(target.reshape(2, -1).T.copy())
    torch.manual_seed(7)
    model = MultidimLinear(2, 2, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for _ in range(epochs):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for i in range(len(X)):
            m = copy.deepcopy(model)
            loss = ((m(X[i]) - Y[i]) ** 2).mean()
            loss.backward()
            grads = [p.grad for p in m.parameters()]
            norm = torch.sqrt(sum((g**2).sum() for g in grads))
            factor = min(1.0, clip / (float(norm) + 1e-6))
            total = [a + factor * g for a, g in zip(total, grads, strict=True)]
        opt.zero_grad()
        for p, g in zip(model.parameters(), total, strict=True):
            p.grad = g / len(X)
        opt.step()
    norms = []
    for i in range(len(X)):  # each pixel's gradient norm at the final weights
        m = copy.deepcopy(model)
        ((m(X[i]) - Y[i]) ** 2).mean().backward()
        norms.append(float(torch.sqrt(sum((p.grad**2).sum() for p in m.parameters()))))
    weights = {k: v.detach().numpy() for k, v in model.named_parameters()}
    return weights, np.array(norms).reshape(y.shape[1:])


def test_trained_weights_match_a_per_sample_loop_on_numpy_lstsq(tmp_path: Path, ctx: Any) -> None:
    cube = cube_with_target(tmp_path / "cube.nc")
    raw = sections(tmp_path, cube, batch_pixels=10_000, clip_norm=0.5, momentum=0.5)
    refs = run(tmp_path, raw, ctx, tile_pixels=50)  # several tiles
    expected, norms = oracle_weights(cube, epochs=3, lr=0.05, clip=0.5, momentum=0.5)
    written = load_file(str(tmp_path / "out.nc.weights.safetensors"))
    assert set(written) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(written[name], value, rtol=1e-7, atol=1e-10, err_msg=name)
    import xarray as xr

    with xr.open_dataset(tmp_path / "out.nc") as ds:
        np.testing.assert_allclose(ds["grad_norm"].values, norms, rtol=1e-5)
    # the model stage ran with those weights
    model = ctx.store.get(refs["model"].prepared.key)
    for name, value in expected.items():
        np.testing.assert_allclose(model.array(f"param:{name}"), value, rtol=1e-7, atol=1e-10)


def test_the_loss_per_epoch_and_counts_are_written(tmp_path: Path, ctx: Any) -> None:
    import xarray as xr

    cube = cube_with_target(tmp_path / "cube.nc")
    raw = sections(tmp_path, cube, epochs=4, batch_pixels=32, validation_fraction=0.25)
    run(tmp_path, raw, ctx)
    with xr.open_dataset(tmp_path / "out.nc") as ds:
        assert ds["train_loss"].dims == ("epoch",) and ds.sizes["epoch"] == 4
        assert list(ds["epoch"].values) == [1, 2, 3, 4]
        assert np.isfinite(ds["val_loss"].values).all()
        assert ds["train_loss"].values[-1] < ds["train_loss"].values[0]
        assert ds.attrs["gridsolve_train_epochs"] == 4
        counts = __import__("json").loads(ds.attrs["gridsolve_train_pixels"])
    assert counts["train_pixels"] + counts["validation_pixels"] == 18 * 14
    assert counts["validation_pixels"] > 0


def test_results_do_not_depend_on_the_tiling(tmp_path: Path, ctx: Any) -> None:
    cube = cube_with_target(tmp_path / "cube.nc")
    weights = []
    for tile_pixels in (30, 1000):
        raw = sections(tmp_path / str(tile_pixels), cube, batch_pixels=20, validation_fraction=0.2)
        refs = run(tmp_path, raw, ctx, tile_pixels=tile_pixels)
        weights.append(ctx.store.get(refs["train"].key).arrays())
    for name in weights[0]:
        # solve agrees within the determinism bound across tilings; training follows it
        np.testing.assert_allclose(weights[0][name], weights[1][name], rtol=1e-8, atol=1e-12)


def test_key_covers_the_module_not_what_the_model_outputs(tmp_path: Path, ctx: Any) -> None:
    cube = cube_with_target(tmp_path / "cube.nc")
    raw = sections(tmp_path, cube, batch_pixels=64)
    first = run(tmp_path, raw, ctx)
    raw["model"] = {**raw["model"], "jacobian": True, "wrt": "both", "objective": "mse"}
    second = run(tmp_path, raw, ctx)
    assert second["train"].key == first["train"].key  # not retrained
    assert second["model"].key != first["model"].key
    raw["model"] = {**raw["model"], "seed": 8}  # another initial module: retrained
    assert run(tmp_path, raw, ctx)["train"].key != first["train"].key


def test_without_training_the_plan_and_keys_are_those_of_before(tmp_path: Path, ctx: Any) -> None:
    cube = cube_with_target(tmp_path / "cube.nc")
    raw = sections(tmp_path, cube)
    raw["train"] = {"impl": "none"}
    plan = build_plan(build_config(raw).stage_configs())
    assert "train" not in [s.kind for s in plan.steps]
    assert [s.kind for s in plan.segments[3].steps] == ["solve", "model"]
    raw.pop("train")
    assert build_plan(build_config(raw).stage_configs()).steps == plan.steps


def test_training_needs_a_target(tmp_path: Path) -> None:
    cube = cube_with_target(tmp_path / "cube.nc")
    raw = sections(tmp_path, cube)
    raw["load"].pop("target")
    with pytest.raises(ConfigError, match=r"load\.target"):
        build_config(raw)


def test_rows_read_the_same_in_memory_and_streamed(tmp_path: Path) -> None:
    from gridsolve.stages.train.stage import Rows

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((50, 6)), rng.standard_normal((50, 2))
    rows = Rows.create(tmp_path, 50, 6, 2, np.dtype(np.float64))
    rows.write(rng.permutation(50), x, y)  # scattered writes, as tiles make them
    memory = rows.reader()  # fits the default budget
    streamed = Rows(rows.x_path, rows.y_path, budget=0).reader()
    for at in (np.array([3, 7, 7, 49, 0]), slice(5, 17), np.array([], dtype=np.int64)):
        for a, b in zip(memory(at), streamed(at), strict=True):
            assert a.tobytes() == b.tobytes()


def test_streaming_the_dataset_gives_the_same_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gridsolve.stages.engine.context import StageContext
    from gridsolve.stages.engine.store import Store
    from gridsolve.stages.train import stage

    cube = cube_with_target(tmp_path / "cube.nc")
    weights = []
    for name, share in (("memory", stage.work_share), ("streamed", lambda budget: 0)):
        monkeypatch.setattr(stage, "work_share", share)  # 0: rows streamed from the files
        ctx = StageContext(store=Store(tmp_path / name / "store"))  # trained afresh
        raw = sections(tmp_path / name, cube, batch_pixels=20, validation_fraction=0.2)
        refs = run(tmp_path, raw, ctx, tile_pixels=1000)
        weights.append(ctx.store.get(refs["train"].key).arrays())
    for key in weights[0]:
        assert weights[0][key].tobytes() == weights[1][key].tobytes(), key
