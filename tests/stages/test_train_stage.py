"""The train stage in the plan: its dataset, its key, and weights against an independent oracle."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from gridsolve.schemas.errors import ConfigError, ContractError
from gridsolve.schemas.pipeline import build_config
from gridsolve.stages.engine.plan import build_plan
from gridsolve.stages.model.multidim_linear import MultidimLinear
from gridsolve.stages.train.sampling import block_split

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


# ---------------------------------------------------------------- the loss curve is the model's
def lstsq_inputs(cube: Path) -> tuple[np.ndarray, np.ndarray]:
    """Each pixel's model input (numpy lstsq coefficients as 2×2) and target, in raster order."""
    import xarray as xr

    with xr.open_dataset(cube) as ds:
        y, target = ds["signal"].values, ds["tgt"].values
        t = ds["time"].values.astype(np.float64)
    u = (t - (t.min() + t.max()) / 2) / ((t.max() - t.min()) / 2)
    A = np.stack([u**k for k in range(4)], axis=1)
    coef = np.linalg.lstsq(A, y.reshape(y.shape[0], -1), rcond=None)[0]
    return coef.T.reshape(-1, 2, 2), target.reshape(target.shape[0], -1).T


def mse_of_written_weights(weights: Path, x: np.ndarray, y: np.ndarray) -> float:
    """Mean over pixels of each pixel's MSE, one plain forward per pixel, float64 sums."""
    model = MultidimLinear(2, 2, 2).double()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in load_file(str(weights)).items()})
    total = 0.0
    with torch.no_grad():
        for xi, yi in zip(x, y, strict=True):
            total += float(((model(torch.from_numpy(xi)) - torch.from_numpy(yi)) ** 2).mean())
    return total / len(x)


def assert_curve_is_the_written_weights(out: Path, cube: Path, at_epoch: int) -> None:
    """train_loss/val_loss at ``at_epoch`` are the written weights' MSE over each side."""
    import xarray as xr

    x, y = lstsq_inputs(cube)
    with xr.open_dataset(out) as ds:
        train_loss, val_loss = ds["train_loss"].values, ds["val_loss"].values
        attrs = dict(ds.attrs)
        ny, nx = ds.sizes["y"], ds.sizes["x"]
    cfg = json.loads(attrs["gridsolve_config"])["train"]
    held = block_split(ny, nx, cfg["validation_fraction"], cfg["seed"]).reshape(-1)
    weights = Path(f"{out}.weights.safetensors")
    mse_train = mse_of_written_weights(weights, x[~held], y[~held])
    mse_val = mse_of_written_weights(weights, x[held], y[held])
    np.testing.assert_allclose(train_loss[at_epoch - 1], mse_train, rtol=1e-9)
    np.testing.assert_allclose(val_loss[at_epoch - 1], mse_val, rtol=1e-9)
    # the split itself does not matter to this one: the MSE over every pixel, pooled
    n_t, n_v = int((~held).sum()), int(held.sum())
    pooled = (n_t * train_loss[at_epoch - 1] + n_v * val_loss[at_epoch - 1]) / (n_t + n_v)
    np.testing.assert_allclose(pooled, mse_of_written_weights(weights, x, y), rtol=1e-9)
    assert attrs["gridsolve_train_best_epoch"] == int(np.argmin(val_loss)) + 1
    assert attrs["gridsolve_train_weights_epoch"] == at_epoch


def test_the_curve_ends_at_the_loss_of_the_written_weights(tmp_path: Path, ctx: Any) -> None:
    import xarray as xr

    cube = cube_with_target(tmp_path / "cube.nc", ny=24, nx=16)
    raw = sections(tmp_path, cube, epochs=5, batch_pixels=32, validation_fraction=0.25)
    run(tmp_path, raw, ctx, tile_pixels=100)  # several tiles
    out = tmp_path / "out.nc"
    assert_curve_is_the_written_weights(out, cube, at_epoch=5)  # no early stopping: the last
    with xr.open_dataset(out) as ds:
        assert ds.attrs["gridsolve_train_weights_from"].startswith("last epoch")
        assert ds["train_loss"].values[-1] < ds["train_loss"].values[0]


def test_early_stopping_writes_the_best_epoch_and_its_losses(tmp_path: Path, ctx: Any) -> None:
    import xarray as xr

    cube = cube_with_target(tmp_path / "cube.nc", ny=24, nx=16)
    raw = sections(
        tmp_path, cube, impl="adam", epochs=12, batch_pixels=64, lr=0.05, clip_norm=None,
        validation_fraction=0.25, early_stopping=2,
    )  # fmt: skip
    run(tmp_path, raw, ctx)
    out = tmp_path / "out.nc"
    with xr.open_dataset(out) as ds:
        best = int(ds.attrs["gridsolve_train_best_epoch"])
        # stopped 2 worse epochs after the best (3 of 5 here), whose weights are written
        assert best == ds.sizes["epoch"] - 2 and ds.sizes["epoch"] < 12
        assert np.isfinite(ds["train_loss"].values).all()
        assert ds.attrs["gridsolve_train_weights_from"].startswith("best validation epoch")
    assert_curve_is_the_written_weights(out, cube, at_epoch=best)


# ---------------------------------------------------------------- nothing to train on
def test_a_map_smaller_than_one_validation_block_is_refused_before_training(
    tmp_path: Path, ctx: Any
) -> None:
    cube = cube_with_target(tmp_path / "cube.nc", ny=5, nx=6)
    raw = sections(tmp_path, cube, validation_fraction=0.1)
    with pytest.raises(ContractError) as err:
        run(tmp_path, raw, ctx)
    msg = str(err.value)
    assert "[train/sgd]" in msg and "5 × 6" in msg and "8 × 8" in msg, msg
    assert "30 usable pixels" in msg and "train.validation_fraction: 0" in msg, msg
    assert not any(ctx.store.root.rglob("X.npy"))  # no row copied
    assert not (tmp_path / "out.nc").exists()


def test_a_target_without_a_finite_value_is_refused_with_the_counts(
    tmp_path: Path, ctx: Any
) -> None:
    cube = cube_with_target(tmp_path / "cube.nc")
    import xarray as xr

    with xr.open_dataset(cube) as ds:
        ds = ds.load()
    ds["tgt"][:] = np.nan
    ds.to_netcdf(tmp_path / "nan.nc")
    raw = sections(tmp_path, tmp_path / "nan.nc", validation_fraction=0.1)
    with pytest.raises(ContractError) as err:
        run(tmp_path, raw, ctx)
    msg = str(err.value)
    assert "none of the 252 pixels" in msg, msg
    assert "252 with no finite value of the target 'tgt'" in msg, msg
    assert "load.target ('tgt')" in msg, msg


def test_a_model_whose_output_is_not_the_targets_size_is_refused_before_training(
    tmp_path: Path, ctx: Any
) -> None:
    cube = cube_with_target(tmp_path / "cube.nc")  # 2 target values per pixel
    raw = sections(tmp_path, cube)
    raw["model"]["output_dim"] = 4
    with pytest.raises(ContractError) as err:
        run(tmp_path, raw, ctx)
    msg = str(err.value)
    assert "the model's output has 4 value(s) per pixel" in msg, msg
    assert "the training target has 2" in msg, msg
    assert "model.output_dim: 2" in msg, msg


@pytest.mark.parametrize(
    ("counts", "shape", "needles"),
    [
        (  # every usable pixel is in a held-out block
            {"train_pixels": 0, "validation_pixels": 40, "excluded_status": 0,
             "excluded_coefficients_not_finite": 0, "excluded_target_not_finite": 216},
            (16, 16),
            ["all 40 fall in the validation blocks", "4 blocks", "216 with no finite value",
             "lower train.validation_fraction"],
        ),
        (  # no usable pixel in the held-out blocks
            {"train_pixels": 30, "validation_pixels": 0, "excluded_status": 226,
             "excluded_coefficients_not_finite": 0, "excluded_target_not_finite": 0},
            (16, 16),
            ["no usable pixel falls in the validation blocks", "30 usable pixels",
             "226 with a solve status outside", "train.validation_fraction: 0"],
        ),
    ],
)  # fmt: skip
def test_an_empty_side_of_the_split_names_its_counts_and_the_fix(
    counts: dict[str, int], shape: tuple[int, int], needles: list[str]
) -> None:
    from gridsolve.schemas.kinds.train import SGDTrain
    from gridsolve.stages.train.stage import check_split

    with pytest.raises(ContractError) as err:
        check_split(SGDTrain(validation_fraction=0.1), counts, shape, "tgt")
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    # the same pixels without validation: all train, nothing refused
    every = {**counts, "train_pixels": counts["train_pixels"] + counts["validation_pixels"]}
    check_split(SGDTrain(validation_fraction=0.0), {**every, "validation_pixels": 0}, shape, "t")


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.usefixtures("prefect_server")
def test_through_gridsolve_run_the_curve_is_the_written_weights(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    cube = cube_with_target(tmp_path / "cube.nc", ny=24, nx=16)
    raw = sections(tmp_path, cube, epochs=5, batch_pixels=32, validation_fraction=0.25)
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(raw))
    gridsolve = str(Path(sys.executable).parent / "gridsolve")
    res = subprocess.run(
        [gridsolve, "run", str(config)], capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "out.nc"
    assert_curve_is_the_written_weights(out, cube, at_epoch=5)
    assert Path(f"{out}.loss.png").read_bytes().startswith(b"\x89PNG")
