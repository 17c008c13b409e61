"""The model stage: per-sample gradients and Jacobians against a per-sample autograd loop."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from schemas.config import (
    LstsqSolve,
    ModuleModel,
    MultidimLinearModel,
    NetCDFLoad,
    RandomDesign,
    SVDNormalEquations,
)
from schemas.errors import ConfigError, ContractError, InputError
from stages.model import build_module
from stages.models import MultidimLinear

from testkit import Chain, make_ds


def run_model(
    chain: Chain, path: Path, model: Any, coef: int = 6, **load: Any
) -> dict[str, np.ndarray]:
    chain.whole("load", NetCDFLoad(path=str(path), **load))
    chain.whole("design", RandomDesign(coef=coef))
    chain.whole("normal_equations", SVDNormalEquations())
    chain.tiled("solve", LstsqSolve())
    (art,) = chain.tiled("model", model)
    coefs = np.array(chain.ctx.store.get(chain.refs["solve"].tiles[0].key).array("coefficients"))
    return {"coefficients": coefs, **{k: np.array(art.array(k)) for k in art.names}}


def pixels(a: np.ndarray) -> np.ndarray:
    """(..., y, x) → (pixels, ...)."""
    return np.moveaxis(a.reshape(*a.shape[:-2], -1), -1, 0)


@pytest.fixture
def grid(write_cube: Any) -> Path:
    return write_cube(make_ds(n_obs=12, ny=15, nx=16))  # 240 pixels


def test_per_sample_gradients_equal_autograd_loop(chain: Chain, grid: Path) -> None:
    cfg = MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4)
    out = run_model(chain, grid, cfg)
    X = pixels(out["coefficients"]).reshape(-1, 3, 2)
    gw, gb = pixels(out["grad:weight"]), pixels(out["grad:bias"])
    pred = pixels(out["prediction"])
    assert X.shape[0] == 240
    module = build_module(cfg)
    for p in range(X.shape[0]):
        y = module(torch.from_numpy(X[p]))
        w, b = torch.autograd.grad(y.sum(), [module.weight, module.bias])
        np.testing.assert_allclose(gw[p], w.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gb[p], b.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pred[p], y.detach().numpy(), rtol=1e-5, atol=1e-6)
    # The usual batched shortcut: one forward, one .backward() — gives only the SUM.
    module.zero_grad()
    batched = torch.einsum("bij,ijo->bo", torch.from_numpy(X), module.weight) + module.bias
    batched.sum().backward()
    np.testing.assert_allclose(module.weight.grad.numpy(), gw.sum(0), rtol=1e-4, atol=1e-4)
    assert not np.allclose(gw[0], gw[1])  # per-sample gradients differ: the sum loses them


def test_batch_size_equal_to_input_dim_is_not_confused(chain: Chain, write_cube: Any) -> None:
    # 10 pixels and input_dim 10: hook-based per-sample libraries can mix up the batch dim here.
    path = write_cube(make_ds(n_obs=12, ny=2, nx=5))
    cfg = MultidimLinearModel(input_dim=10, hidden_dim=1, output_dim=3)
    out = run_model(chain, path, cfg, coef=10)
    X = pixels(out["coefficients"]).reshape(-1, 10, 1)
    module = build_module(cfg)
    for p in range(10):
        (w,) = torch.autograd.grad(module(torch.from_numpy(X[p])).sum(), [module.weight])
        np.testing.assert_allclose(pixels(out["grad:weight"])[p], w.numpy(), rtol=1e-5, atol=1e-6)


def test_user_module_jacobian_and_input_gradient(chain: Chain, grid: Path) -> None:
    cfg = ModuleModel(
        target="my_models:TinyMLP",
        kwargs={"n_in": 6, "hidden": 4, "n_out": 3},
        input_shape=(6,),
        wrt="both",
        jacobian=True,
    )
    out = run_model(chain, grid, cfg)
    X = pixels(out["coefficients"])
    module = build_module(cfg)
    names = [n for n, _ in module.named_parameters()]
    for p in range(0, 240, 7):
        x = torch.from_numpy(X[p]).requires_grad_(True)
        y = module(x)
        grads = torch.autograd.grad(y.sum(), [*module.parameters(), x], retain_graph=True)
        for name, g in zip([*names, "input"], grads, strict=True):
            np.testing.assert_allclose(
                pixels(out[f"grad:{name}"])[p], g.numpy(), rtol=1e-5, atol=1e-6
            )
        for o in range(3):
            rows = torch.autograd.grad(y[o], [*module.parameters(), x], retain_graph=True)
            for name, g in zip([*names, "input"], rows, strict=True):
                np.testing.assert_allclose(
                    pixels(out[f"jac:{name}"])[p][o], g.numpy(), rtol=1e-5, atol=1e-6
                )


def test_mse_objective_against_target(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=4, nx=5)
    target = np.random.default_rng(3).standard_normal((2, 4, 5))
    ds["t"] = (("out", "y", "x"), target)
    path = write_cube(ds)
    cfg = ModuleModel(
        target="my_models:TinyMLP", kwargs={"n_in": 6}, input_shape=(6,), objective="mse"
    )
    out = run_model(chain, path, cfg, variable="signal", target="t")
    X, T = pixels(out["coefficients"]), pixels(target)
    module = build_module(cfg)
    for p in range(20):
        loss = ((module(torch.from_numpy(X[p])) - torch.from_numpy(T[p]).float()) ** 2).mean()
        g = torch.autograd.grad(loss, [module.layer1.weight])[0]
        np.testing.assert_allclose(
            pixels(out["grad:layer1.weight"])[p], g.numpy(), rtol=1e-5, atol=1e-6
        )


def test_weights_from_safetensors_and_torch_save(chain: Chain, grid: Path, tmp_path: Path) -> None:
    ref = MultidimLinear(3, 2, 4)
    with torch.no_grad():
        ref.weight.copy_(torch.arange(24.0).reshape(3, 2, 4) / 10)
        ref.bias.fill_(0.5)
    st = tmp_path / "w.safetensors"
    save_file(ref.state_dict(), str(st))
    pt = tmp_path / "w.pt"
    torch.save(ref.state_dict(), pt)
    outs = []
    for path in (st, pt):
        outs.append(
            run_model(
                Chain(chain.ctx),
                grid,
                MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4, weights=str(path)),
            )
        )
    X = pixels(outs[0]["coefficients"]).reshape(-1, 3, 2)
    expected = ref(torch.from_numpy(X)[0]).detach().numpy()
    for out in outs:
        np.testing.assert_allclose(pixels(out["prediction"])[0], expected, rtol=1e-6)


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("this should never run",))


def test_pickle_with_objects_is_refused(chain: Chain, grid: Path, tmp_path: Path) -> None:
    bad = tmp_path / "evil.pt"
    with open(bad, "wb") as f:
        pickle.dump({"weight": Evil()}, f)
    with pytest.raises(InputError) as err:
        run_model(chain, grid, MultidimLinearModel(input_dim=3, hidden_dim=2, weights=str(bad)))
    assert "refused to load" in str(err.value) and "safetensors" in str(err.value)


def test_checkpoint_shape_mismatch_lists_every_tensor(
    chain: Chain, grid: Path, tmp_path: Path
) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"weight": torch.zeros(3, 2, 5), "extra": torch.zeros(1)}, str(path))
    with pytest.raises(ContractError) as err:
        run_model(
            chain,
            grid,
            MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4, weights=str(path)),
        )
    text = str(err.value)
    assert "missing tensor 'bias'" in text and "unexpected tensor 'extra'" in text
    assert "weight: file has shape (3, 2, 5), the model needs (3, 2, 4)" in text


def test_input_shape_must_hold_coefficients(chain: Chain, grid: Path) -> None:
    with pytest.raises(ContractError) as err:
        run_model(chain, grid, MultidimLinearModel(input_dim=10, hidden_dim=10))
    assert "coef = 6" in str(err.value) and "(10, 10)" in str(err.value)


def test_model_written_for_a_batch_is_named(chain: Chain, grid: Path) -> None:
    with pytest.raises(ContractError, match="fails on one sample"):
        run_model(chain, grid, ModuleModel(target="my_models:Batched", input_shape=(6,)))


def test_unknown_module_import(chain: Chain, grid: Path) -> None:
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg'"):
        run_model(chain, grid, ModuleModel(target="no_such_pkg:Model", input_shape=(6,)))


def test_nan_coefficients_give_nan_outputs(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=3, nx=3)
    ds["signal"][:, 1, 1] = np.nan
    out = run_model(chain, write_cube(ds), MultidimLinearModel(input_dim=3, hidden_dim=2))
    assert (
        np.isnan(out["prediction"][:, 1, 1]).all() and np.isnan(out["grad:weight"][..., 1, 1]).all()
    )
    assert np.isfinite(out["prediction"][:, 0, 0]).all()
