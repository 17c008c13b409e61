"""The model stage: per-sample gradients and Jacobians against a per-sample autograd loop."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import netCDF4
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gridsolve.schemas.contracts import MODEL_STATUS_CODES, MODEL_STATUS_FLAGS
from gridsolve.schemas.errors import ConfigError, ContractError, InputError
from gridsolve.schemas.kinds.design import RandomDesign
from gridsolve.schemas.kinds.load import NetCDFLoad
from gridsolve.schemas.kinds.model import ModuleModel, MultidimLinearModel
from gridsolve.schemas.kinds.normal_equations import SVDNormalEquations
from gridsolve.schemas.kinds.solve import LstsqSolve
from gridsolve.schemas.kinds.write import NetCDFWrite
from gridsolve.stages.model.building import build_module
from gridsolve.stages.model.multidim_linear import MultidimLinear

import my_models
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
    assert out["model_status"][1, 1] == MODEL_STATUS_CODES["input_not_finite"]
    assert out["model_status"][0, 0] == MODEL_STATUS_CODES["ok"]


# ---------------------------------------------------------------- the whole checkpoint
def checkpoint(module: torch.nn.Module, path: Path) -> Path:
    """Save ``module``'s full state dict (parameters and buffers) as safetensors or torch.save."""
    if path.suffix == ".safetensors":
        save_file(module.state_dict(), str(path))
    else:
        torch.save(module.state_dict(), path)
    return path


def oracle_from(cls: type[torch.nn.Module], path: Path, **kwargs: Any) -> torch.nn.Module:
    """The real module, its whole checkpoint loaded with load_state_dict, in eval mode."""
    module = cls(**kwargs)
    state = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path)
    module.load_state_dict(state)
    return module.eval()


def check_against_oracle(
    out: dict[str, np.ndarray],
    module: torch.nn.Module,
    rows: range,
    *,
    target: np.ndarray | None = None,
    jacobian: bool = False,
) -> None:
    """Prediction, gradients (params and input) and Jacobians of each pixel, by autograd."""
    X = pixels(out["coefficients"])
    names = [n for n, _ in module.named_parameters()]
    for p in rows:
        x = torch.from_numpy(X[p]).float().requires_grad_(True)
        y = module(x).reshape(-1)
        loss = (
            y.sum() if target is None else ((y - torch.from_numpy(target[p]).float()) ** 2).mean()
        )
        grads = torch.autograd.grad(loss, [*module.parameters(), x], retain_graph=True)
        np.testing.assert_allclose(
            pixels(out["prediction"])[p], y.detach().numpy(), rtol=1e-5, atol=1e-6
        )
        for name, g in zip([*names, "input"], grads, strict=True):
            np.testing.assert_allclose(
                pixels(out[f"grad:{name}"])[p], g.numpy(), rtol=1e-5, atol=1e-6, err_msg=name
            )
        if jacobian:
            for o in range(y.numel()):
                rows_o = torch.autograd.grad(y[o], [*module.parameters(), x], retain_graph=True)
                for name, g in zip([*names, "input"], rows_o, strict=True):
                    np.testing.assert_allclose(
                        pixels(out[f"jac:{name}"])[p][o], g.numpy(), rtol=1e-5, atol=1e-6
                    )


def test_checkpoint_buffer_is_used(chain: Chain, grid: Path, tmp_path: Path) -> None:
    torch.manual_seed(1)
    ref = my_models.Scaled()
    ref.scale.fill_(3.0)  # type: ignore[operator]
    path = checkpoint(ref, tmp_path / "scaled.safetensors")
    cfg = ModuleModel(target="my_models:Scaled", input_shape=(6,), weights=str(path), wrt="both")
    out = run_model(chain, grid, cfg)
    assert "grad:scale" not in out  # buffers are constants, not differentiated
    oracle = oracle_from(my_models.Scaled, path)
    check_against_oracle(out, oracle, range(240))
    # Without the buffer the prediction would be a third of this.
    unscaled = oracle.lin(torch.from_numpy(pixels(out["coefficients"])[0]).float())
    np.testing.assert_allclose(
        pixels(out["prediction"])[0], 3 * unscaled.detach().numpy(), rtol=1e-5
    )


def test_model_that_vmap_cannot_batch_over_parameter_copies_equals_autograd_loop(
    chain: Chain, grid: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Eager gradients go through per-pixel copies of the parameters; this forward copies a
    # parameter into an unbatched tensor in place, which only vmap(vjp) can batch.
    torch.manual_seed(4)
    path = checkpoint(my_models.InPlaceBias(), tmp_path / "inplace.safetensors")
    cfg = ModuleModel(
        target="my_models:InPlaceBias", input_shape=(6,), weights=str(path), wrt="both"
    )
    with caplog.at_level(logging.DEBUG, logger="gridsolve"):
        out = run_model(chain, grid, cfg)
    assert any("by vmap(vjp)" in r.getMessage() for r in caplog.records)  # the fallback ran
    assert out["grad:b"].shape[0] == 2
    check_against_oracle(out, oracle_from(my_models.InPlaceBias, path), range(0, 240, 3))


PER_SAMPLE_IMPORTS = """
import sys, torch
from gridsolve.schemas.kinds.model import MultidimLinearModel
from gridsolve.stages.model.building import build_module
from gridsolve.stages.model.per_sample import _per_sample_fns
wrt, objective = sys.argv[1:]
cfg = MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4, wrt=wrt, objective=objective)
module = build_module(cfg)
params = {k: v.detach() for k, v in module.named_parameters()}
target = torch.randn(9, 4) if objective == "mse" else None
grads, outputs = _per_sample_fns(module, cfg)[1](params, {}, torch.randn(9, 3, 2), target)
by_param = grads if wrt == "params" else grads[0] if wrt == "both" else None
assert by_param is None or by_param["weight"].shape == (9, 3, 2, 4)
assert outputs.shape == (9, 4), outputs.shape
print(" ".join(m for m in ("torch._dynamo", "sympy") if m in sys.modules) or "none")
"""


@pytest.mark.parametrize(
    ("wrt", "objective"), [("params", "sum"), ("both", "mse"), ("input", "sum")]
)
def test_eager_per_sample_gradients_import_neither_dynamo_nor_sympy(
    wrt: str, objective: str
) -> None:
    # Importing them cost 1.1-1.6 s, most of a small run's model stage (issue 29).
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-c", PER_SAMPLE_IMPORTS, wrt, objective],
        capture_output=True,
        text=True,
        check=True,
    )
    assert res.stdout.split() == ["none"], res.stdout + res.stderr


def test_checkpoint_without_a_buffer_is_refused(chain: Chain, grid: Path, tmp_path: Path) -> None:
    path = tmp_path / "params_only.safetensors"
    save_file(dict(my_models.Scaled().named_parameters()), str(path))
    cfg = ModuleModel(target="my_models:Scaled", input_shape=(6,), weights=str(path))
    with pytest.raises(ContractError) as err:
        run_model(chain, grid, cfg)
    assert "missing tensor 'scale' of shape ()" in str(err.value)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_integer_first_entry_does_not_set_the_dtype(
    chain: Chain, grid: Path, tmp_path: Path, suffix: str
) -> None:
    torch.manual_seed(2)
    ref = my_models.IntBufferFirst()
    ref.offset.fill_(5)  # type: ignore[operator]
    first, tensor = next(iter(ref.state_dict().items()))
    assert first == "offset" and tensor.dtype == torch.int64  # the case under test
    path = checkpoint(ref, tmp_path / f"w{suffix}")
    cfg = ModuleModel(
        target="my_models:IntBufferFirst", input_shape=(6,), weights=str(path), wrt="both"
    )
    out = run_model(chain, grid, cfg)
    assert np.abs(pixels(out["grad:lin.weight"])).max() > 0
    check_against_oracle(out, oracle_from(my_models.IntBufferFirst, path), range(0, 240, 3))


def test_batchnorm_eval_uses_running_statistics(chain: Chain, grid: Path, tmp_path: Path) -> None:
    torch.manual_seed(3)
    ref = my_models.WithBatchNorm()
    with torch.no_grad():
        ref.bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.1]))  # type: ignore[operator]
        ref.bn.running_var.copy_(torch.tensor([0.25, 4.0, 1.5, 0.8]))  # type: ignore[operator]
        ref.bn.num_batches_tracked.fill_(17)  # type: ignore[operator]
        ref.bn.weight.copy_(torch.tensor([1.5, 0.5, -1.0, 2.0]))
        ref.bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    path = checkpoint(ref, tmp_path / "bn.safetensors")
    cfg = ModuleModel(
        target="my_models:WithBatchNorm",
        input_shape=(6,),
        weights=str(path),
        wrt="both",
        jacobian=True,
    )
    assert cfg.mode == "eval"  # the default
    out = run_model(chain, grid, cfg)
    check_against_oracle(
        out, oracle_from(my_models.WithBatchNorm, path), range(0, 240, 5), jacobian=True
    )


def test_train_mode_batchnorm_and_dropout_are_refused(chain: Chain, grid: Path) -> None:
    with pytest.raises(ConfigError) as err:
        run_model(
            chain,
            grid,
            ModuleModel(target="my_models:WithBatchNorm", input_shape=(6,), mode="train"),
        )
    text = str(err.value)
    assert "BatchNorm" in text and "bn" in text and "model.mode: eval" in text
    with pytest.raises(ConfigError) as err:
        run_model(
            Chain(chain.ctx),
            grid,
            ModuleModel(target="my_models:WithDropout", input_shape=(6,), mode="train"),
        )
    assert "Dropout" in str(err.value) and "drop" in str(err.value)


def test_dropout_is_off_in_eval_mode(chain: Chain, grid: Path, tmp_path: Path) -> None:
    ref = my_models.WithDropout()
    path = checkpoint(ref, tmp_path / "d.pt")
    cfg = ModuleModel(
        target="my_models:WithDropout", input_shape=(6,), weights=str(path), wrt="both"
    )
    out = run_model(chain, grid, cfg)
    check_against_oracle(out, oracle_from(my_models.WithDropout, path), range(0, 240, 11))


def test_train_mode_of_a_per_sample_model_runs(chain: Chain, grid: Path) -> None:
    kw = {"target": "my_models:TinyMLP", "kwargs": {"n_in": 6}, "input_shape": (6,)}
    train = run_model(chain, grid, ModuleModel(**kw, mode="train"))
    evaluated = run_model(Chain(chain.ctx), grid, ModuleModel(**kw))
    np.testing.assert_array_equal(train["prediction"], evaluated["prediction"])


# ---------------------------------------------------------------- refused at prepare
@pytest.mark.parametrize("target", ["my_models:ItemForward", "my_models:BranchOnValue"])
def test_forward_vmap_cannot_batch_is_refused_at_prepare(
    chain: Chain, grid: Path, target: str
) -> None:
    from gridsolve.stages.engine.runner import prepare_stage

    chain.whole("load", NetCDFLoad(path=str(grid)))
    chain.whole("design", RandomDesign(coef=6))
    chain.whole("normal_equations", SVDNormalEquations())
    chain.tiled("solve", LstsqSolve())
    cfg = ModuleModel(target=target, input_shape=(6,))
    refs = {k: chain.refs[k] for k in ("load", "design", "solve")}
    with pytest.raises(ContractError) as err:
        prepare_stage(cfg, refs, chain.ctx)  # before any tile runs
    text = str(err.value)
    assert target in text and "cannot be batched over pixels" in text and "forward" in text
    assert "write forward with tensor ops only" in text and ".item()" in text
    assert "if/while on tensor values" in text and "likely a bug" not in text


def test_forward_that_modifies_a_buffer_is_refused(chain: Chain, grid: Path) -> None:
    with pytest.raises(ContractError) as err:
        run_model(chain, grid, ModuleModel(target="my_models:CountsCalls", input_shape=(6,)))
    assert "modifies buffer 'calls' in place" in str(err.value)


@pytest.mark.parametrize(
    ("target", "found"),
    [
        ("my_models:TupleOut", "returns a tuple of 2 (Tensor (2,), Tensor ())"),
        ("my_models:DictOut", "returns a dict with keys ['h', 'total']"),
    ],
)
def test_tuple_and_dict_outputs_are_refused_with_a_fix(
    chain: Chain, grid: Path, target: str, found: str
) -> None:
    with pytest.raises(ContractError) as err:
        run_model(chain, grid, ModuleModel(target=target, input_shape=(6,)))
    text = str(err.value)
    assert found in text and "not one tensor" in text
    assert "fix:      return one tensor, e.g. torch.cat(" in text


# ---------------------------------------------------------------- model_status
def test_nan_target_flags_model_status(chain: Chain, write_cube: Any, tmp_path: Path) -> None:
    ds = make_ds(n_obs=12, ny=4, nx=5)
    ds["signal"][:, 0, 0] = np.nan  # no coefficients: input_not_finite
    target = np.random.default_rng(4).standard_normal((2, 4, 5))
    target[1, 1, 2] = np.nan  # one of the two target values
    target[:, 3, 4] = np.nan
    ds["t"] = (("out", "y", "x"), target)
    path = write_cube(ds)
    cfg = ModuleModel(
        target="my_models:TinyMLP",
        kwargs={"n_in": 6},
        input_shape=(6,),
        objective="mse",
        wrt="both",
        jacobian=True,
    )
    out = run_model(chain, path, cfg, variable="signal", target="t")
    status = out["model_status"]
    expected = np.zeros((4, 5), np.int8)
    expected[0, 0] = MODEL_STATUS_CODES["input_not_finite"]
    expected[1, 2] = expected[3, 4] = MODEL_STATUS_CODES["target_not_finite"]
    np.testing.assert_array_equal(status, expected)
    for y, x in ((1, 2), (3, 4)):
        # The gradient of the objective is undefined there; the outputs themselves are not.
        assert all(np.isnan(out[k][..., y, x]).all() for k in out if k.startswith("grad:"))
        assert np.isfinite(out["prediction"][:, y, x]).all()
        assert np.isfinite(out["jac:layer1.weight"][..., y, x]).all()
    module = build_module(cfg)
    check_against_oracle(out, module, range(1, 7), target=pixels(target), jacobian=True)

    chain.whole("write", NetCDFWrite(path=str(tmp_path / "out.nc")))
    with netCDF4.Dataset(tmp_path / "out.nc") as nc:
        var = nc.variables["model_status"]
        assert var.dimensions == ("y", "x")
        assert list(var.flag_values) == sorted(MODEL_STATUS_FLAGS)
        assert var.flag_meanings.split() == [
            MODEL_STATUS_FLAGS[k] for k in sorted(MODEL_STATUS_FLAGS)
        ]
        np.testing.assert_array_equal(var[:], expected)


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
@pytest.mark.parametrize("compile_mode", ["never", "always"])
def test_non_finite_outputs_are_not_ok(
    chain: Chain, grid: Path, tmp_path: Path, compile_mode: str
) -> None:
    """A pixel is output_not_finite exactly when one of its stored outputs is NaN or ±inf.

    Both kernels: the compiled one flags pixels with its own reduction. The
    outputs mix NaN (log of a negative), +inf (log of an overflowed product),
    huge finite values and ordinary ones.
    """
    from gridsolve.stages.model import compiled

    coefs = run_model(chain, grid, MultidimLinearModel(input_dim=3, hidden_dim=2))["coefficients"]
    c0 = coefs[0].ravel().astype(np.float64)
    ref = my_models.LogOutput()
    scale = 1.0e38
    with torch.no_grad():
        ref.lin.weight.zero_()
        # Output 0: log(s·c0 + b) is +inf where s·c0 + b overflows float32 (a quarter of the
        # pixels) and a finite value near log(3.4e38) elsewhere; output 1: log(c0 - median)
        # is NaN for half of the pixels. c0 may be of either sign.
        sign = 1.0 if np.median(c0) > 0 else -1.0
        q = float(np.quantile(sign * c0, 0.75))
        ref.lin.weight[0, 0] = sign * scale
        ref.lin.weight[1, 0] = 1.0
        ref.lin.bias.copy_(torch.tensor([3.4e38 - scale * q, -float(np.median(c0))]))
    path = checkpoint(ref, tmp_path / "log.pt")
    compiled._forget_compiled()
    run = Chain(chain.ctx)
    try:
        out = run_model(
            run,
            grid,
            ModuleModel(
                target="my_models:LogOutput",
                input_shape=(6,),
                weights=str(path),
                compile=compile_mode,
            ),
        )
    finally:
        compiled._forget_compiled()
    assert kernel_used(run) == ("compiled" if compile_mode == "always" else "eager")
    pred = out["prediction"]
    assert np.isnan(pred).any() and np.isposinf(pred).any() and np.isfinite(pred).any()
    stored = [v for k, v in out.items() if k == "prediction" or k.startswith("grad:")]
    bad = np.zeros(pred.shape[1:], bool)
    for v in stored:
        bad |= ~np.isfinite(v.reshape(-1, *pred.shape[1:])).all(axis=0)
    assert 0 < bad.sum() < bad.size
    status = out["model_status"]
    np.testing.assert_array_equal(status[bad], MODEL_STATUS_CODES["output_not_finite"])
    assert (status[~bad] == MODEL_STATUS_CODES["ok"]).all()


# ---------------------------------------------------------------- compiled and eager paths
@pytest.fixture
def fresh_kernels() -> Any:
    """No compiled kernel carried over from another test (they are cached per process)."""
    from gridsolve.stages.model import compiled

    compiled._forget_compiled()
    yield compiled
    compiled._forget_compiled()


def kernel_used(chain: Chain) -> str:
    (run,) = chain.runs["model"]
    return str(chain.ctx.store.get(run.ref.key).meta["kernel"])


def wrap_compiled(monkeypatch: Any, around: Callable[..., Any]) -> None:
    """torch.compile really compiles, and every call of the result goes through
    ``around(compiled, params, buffers, x, target, outputs)``."""
    real_compile = torch.compile

    def compile_(fn: Any, **kwargs: Any) -> Any:
        compiled = real_compile(fn, **kwargs)
        return lambda *args: around(compiled, *args)

    monkeypatch.setattr(torch, "compile", compile_)


def test_compiled_gradients_equal_autograd_loop(
    chain: Chain, grid: Path, fresh_kernels: Any
) -> None:
    cfg = MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4, compile="always")
    out = run_model(chain, grid, cfg)
    assert kernel_used(chain) == "compiled"
    X = pixels(out["coefficients"]).reshape(-1, 3, 2)
    gw, gb, pred = pixels(out["grad:weight"]), pixels(out["grad:bias"]), pixels(out["prediction"])
    module = build_module(cfg)
    for p in range(X.shape[0]):
        y = module(torch.from_numpy(X[p]))
        w, b = torch.autograd.grad(y.sum(), [module.weight, module.bias])
        np.testing.assert_allclose(gw[p], w.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gb[p], b.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pred[p], y.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_compiled_kernel_failing_mid_tile_finishes_eager(
    chain: Chain, grid: Path, fresh_kernels: Any, monkeypatch: Any, caplog: Any
) -> None:
    chunk_calls: list[int] = []

    def fails_later(compiled: Any, *args: Any) -> Any:
        if args[2].shape[-1] != fresh_kernels.COMPILE_CHECK_PIXELS:  # a chunk, not a probe
            chunk_calls.append(args[2].shape[-1])
            if len(chunk_calls) == 2:
                raise RuntimeError("out of compiled luck")
        return compiled(*args)

    wrap_compiled(monkeypatch, fails_later)
    cfg = MultidimLinearModel(
        input_dim=3, hidden_dim=2, output_dim=4, compile="always", chunk_pixels=50
    )
    with caplog.at_level("WARNING", logger="gridsolve"):
        out = run_model(chain, grid, cfg)
    assert "compiled kernel failed, running eager: RuntimeError: out of compiled luck" in (
        caplog.text
    )
    assert kernel_used(chain) == "eager"  # what ran at the end
    assert len(chunk_calls) == 2  # after the failure, no compiled call
    X = pixels(out["coefficients"]).reshape(-1, 3, 2)
    gw, pred = pixels(out["grad:weight"]), pixels(out["prediction"])
    module = build_module(cfg)
    for p in range(X.shape[0]):  # every chunk's outputs, before and after the failure
        y = module(torch.from_numpy(X[p]))
        (w,) = torch.autograd.grad(y.sum(), [module.weight])
        np.testing.assert_allclose(gw[p], w.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pred[p], y.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_single_pixel_chunks_run_and_are_labelled_eager(
    chain: Chain, grid: Path, fresh_kernels: Any
) -> None:
    """One-pixel chunks never run compiled (the compiler would specialise on 1)."""
    cfg = MultidimLinearModel(input_dim=3, hidden_dim=2, compile="always", chunk_pixels=1)
    run_model(chain, grid, cfg)
    assert kernel_used(chain) == "eager"


@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_compiled_mse_input_gradients_and_jacobians_equal_autograd(
    chain: Chain, write_cube: Any, fresh_kernels: Any
) -> None:
    ds = make_ds(n_obs=12, ny=6, nx=7)
    ds["signal"][:, 0, 1] = np.nan  # a pixel without coefficients inside a compiled chunk
    target = np.random.default_rng(5).standard_normal((2, 6, 7))
    ds["t"] = (("out", "y", "x"), target)
    kw: dict[str, Any] = {
        "target": "my_models:TinyMLP",
        "kwargs": {"n_in": 6},
        "input_shape": (6,),
        "objective": "mse",
        "wrt": "both",
        "jacobian": True,
    }
    path = write_cube(ds)
    out = run_model(chain, path, ModuleModel(**kw, compile="always"), variable="signal", target="t")
    assert kernel_used(chain) == "compiled"
    assert out["model_status"][0, 1] == MODEL_STATUS_CODES["input_not_finite"]
    assert all(np.isnan(out[k][..., 0, 1]).all() for k in out if k != "model_status")
    module = build_module(ModuleModel(**kw))
    check_against_oracle(
        out, module, [p for p in range(42) if p != 1], target=pixels(target), jacobian=True
    )
    eager = run_model(
        Chain(chain.ctx), path, ModuleModel(**kw, compile="never"), variable="signal", target="t"
    )
    from gridsolve.stages.engine.agreement import disagreements

    assert disagreements(out, eager) == []  # within the project's agreement bound


def test_compile_failure_falls_back_to_eager(
    chain: Chain, grid: Path, fresh_kernels: Any, monkeypatch: Any, caplog: Any
) -> None:
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch, "compile", unavailable)
    kw = {"input_dim": 3, "hidden_dim": 2, "output_dim": 4}
    with caplog.at_level("WARNING", logger="gridsolve"):
        out = run_model(chain, grid, MultidimLinearModel(**kw, compile="always"))
    assert kernel_used(chain) == "eager"
    assert "torch.compile failed, running eager" in caplog.text
    assert "no C++ compiler here" in caplog.text
    eager = run_model(Chain(chain.ctx), grid, MultidimLinearModel(**kw, compile="never"))
    for k in out:
        np.testing.assert_array_equal(out[k], eager[k])


def test_compiled_kernel_that_disagrees_is_not_used(
    chain: Chain, grid: Path, fresh_kernels: Any, monkeypatch: Any, caplog: Any
) -> None:
    def wrong(fn: Any, **kwargs: Any) -> Any:
        def run(*args: Any) -> Any:
            flags = fn(*args)
            args[-1]["prediction"].mul_(1.001)  # far beyond 64 ulp
            return flags

        return run

    monkeypatch.setattr(torch, "compile", wrong)
    with caplog.at_level("WARNING", logger="gridsolve"):
        run_model(chain, grid, MultidimLinearModel(input_dim=3, hidden_dim=2, compile="always"))
    assert kernel_used(chain) == "eager"
    assert "disagrees with eager beyond the agreement bound" in caplog.text
    assert "prediction" in caplog.text


def test_compiled_kernel_with_wrong_finite_flags_is_not_used(
    chain: Chain, grid: Path, fresh_kernels: Any, monkeypatch: Any, caplog: Any
) -> None:
    """Flags that call a NaN output finite (e.g. a compiler folding o - o to 0) are caught."""

    def all_finite(compiled: Any, *args: Any) -> Any:
        flags = compiled(*args)
        return None if flags is None else torch.ones_like(flags)

    wrap_compiled(monkeypatch, all_finite)
    with caplog.at_level("WARNING", logger="gridsolve"):
        run_model(chain, grid, MultidimLinearModel(input_dim=3, hidden_dim=2, compile="always"))
    assert kernel_used(chain) == "eager"
    assert "finite flags wrong at 1 of" in caplog.text


def test_compiled_kernel_of_a_model_that_refuses_nan_checks_outputs_itself(
    chain: Chain, grid: Path, fresh_kernels: Any, monkeypatch: Any, caplog: Any
) -> None:
    """Its flags cannot be checked on a NaN probe: they are dropped, not trusted blindly."""
    seen: list[Any] = []

    def refuses_nan(compiled: Any, *args: Any) -> Any:
        if bool(torch.isnan(args[2]).any()):
            raise ValueError("NaN input")
        flags = compiled(*args)
        seen.append(flags)
        if len(seen) == 1 or flags is None:  # the start-up probe: right flags
            return flags
        # then every pixel "not finite": wrong, so the statuses show if they were trusted
        return torch.zeros_like(flags)

    wrap_compiled(monkeypatch, refuses_nan)
    cfg = MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4, compile="always")
    with caplog.at_level("INFO", logger="gridsolve"):
        out = run_model(chain, grid, cfg)
    assert kernel_used(chain) == "compiled"
    assert "refuses a NaN input" in caplog.text
    assert len(seen) > 1  # the compiled function did run the chunks
    # a linear model's outputs are finite wherever its input is
    status = out["model_status"]
    assert (status == MODEL_STATUS_CODES["ok"]).sum() > 0
    assert not (status == MODEL_STATUS_CODES["output_not_finite"]).any()


def test_compile_is_speed_only(chain: Chain, grid: Path) -> None:
    kw = {"input_dim": 3, "hidden_dim": 2, "output_dim": 4}
    assert "compile" in MultidimLinearModel.speed_fields()
    assert "compile" not in MultidimLinearModel(**kw, compile="always").key_payload()
    run_model(chain, grid, MultidimLinearModel(**kw, compile="never"))
    other = Chain(chain.ctx)
    run_model(other, grid, MultidimLinearModel(**kw, compile="auto"))
    assert chain.refs["model"].key == other.refs["model"].key


def test_mostly_missing_tile_computes_only_valid_pixels(chain: Chain, write_cube: Any) -> None:
    ds = make_ds(n_obs=12, ny=5, nx=6)
    keep = np.zeros((5, 6), bool)
    keep[1, 2] = keep[3, 0] = keep[4, 5] = True  # 3 of 30 pixels have data
    ds["signal"].values[:, ~keep] = np.nan
    cfg = ModuleModel(target="my_models:TinyMLP", kwargs={"n_in": 6}, input_shape=(6,), wrt="both")
    out = run_model(chain, write_cube(ds), cfg)
    assert (out["model_status"][~keep] == MODEL_STATUS_CODES["input_not_finite"]).all()
    assert (out["model_status"][keep] == MODEL_STATUS_CODES["ok"]).all()
    assert all(np.isnan(out[k][..., ~keep]).all() for k in out if k != "model_status")
    flat = np.flatnonzero(keep.ravel())
    check_against_oracle(out, build_module(cfg), flat)


@pytest.mark.parametrize("missing", [False, True])
def test_outputs_are_filled_where_the_store_keeps_them(
    mappable_tmp: Path,
    chain: Chain,
    write_cube: Any,
    monkeypatch: pytest.MonkeyPatch,
    missing: bool,
) -> None:
    # The per-sample gradients are most of a run's bytes: computed into the files the
    # store keeps (staged), not into memory and written again, dense tile or mostly missing.
    from gridsolve.stages.engine.store import Staging

    adopted: list[tuple[str, ...]] = []
    adopt = Staging.adopt

    def spy(self: Staging, arr: np.ndarray) -> Path | None:
        found = adopt(self, arr)
        adopted.append(tuple(arr.shape) if found is not None else ())
        return found

    monkeypatch.setattr(Staging, "adopt", spy)
    ds = make_ds(n_obs=12, ny=5, nx=6)
    if missing:
        ds["signal"].values[:, 1:, :] = np.nan
    cfg = MultidimLinearModel(input_dim=2, hidden_dim=3, output_dim=4)
    out = run_model(chain, write_cube(ds), cfg)
    # the model tile's four arrays come last; model_status (int8 flags) is made in memory
    assert sorted(adopted[-4:]) == [(), (2, 3, 4, 5, 6), (4, 5, 6), (4, 5, 6)]
    # and they are its outputs: against autograd, pixel by pixel (NaN where no coefficients)
    X = pixels(out["coefficients"]).reshape(-1, 2, 3)
    gw, gb, pred = (pixels(out[k]) for k in ("grad:weight", "grad:bias", "prediction"))
    module = build_module(cfg)
    for p in range(30):
        if not np.isfinite(X[p]).all():
            assert np.isnan(gw[p]).all() and np.isnan(gb[p]).all() and np.isnan(pred[p]).all()
            continue
        y = module(torch.from_numpy(X[p]))
        w, b = torch.autograd.grad(y.sum(), [module.weight, module.bias])
        np.testing.assert_allclose(gw[p], w.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gb[p], b.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pred[p], y.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert np.isnan(X).any() == missing


class _ReweightedLinear(MultidimLinear):
    """A user's subclass that changes the forward: the closed form no longer holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("objective", ["sum", "mse"])
def test_closed_form_gradients_equal_the_autograd_route(
    objective: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gridsolve.stages.model import chunk_kernel
    from gridsolve.stages.model.per_sample import _closed_form

    cfg = MultidimLinearModel(
        input_dim=3, hidden_dim=2, output_dim=4, objective=objective, dtype=dtype
    )
    module = build_module(cfg).to(getattr(torch, dtype))
    assert _closed_form(module, cfg) is not None
    params = {k: v.detach() for k, v in module.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 50, generator=gen, dtype=module.weight.dtype)  # (coef, m) pixel-last
    t = torch.randn(4, 50, generator=gen, dtype=x.dtype) if objective == "mse" else None

    def outputs() -> dict[str, torch.Tensor]:
        # slices of wider arrays, as the tile's chunks are
        shapes = {"prediction": (4,), "grad:weight": (3, 2, 4), "grad:bias": (4,)}
        return {
            k: torch.full((*s, 70), np.nan, dtype=x.dtype)[..., 10:60] for k, s in shapes.items()
        }

    closed_out = outputs()
    chunk_kernel.make_kernel(module, cfg, (3, 2))(params, {}, x[:, :], t, closed_out)
    monkeypatch.setattr(chunk_kernel, "_closed_form", lambda *a: None)
    autograd_out = outputs()
    chunk_kernel.make_kernel(module, cfg, (3, 2))(params, {}, x, t, autograd_out)
    for k in closed_out:
        # the same operations up to d loss/d y, then one exact product per element
        torch.testing.assert_close(closed_out[k], autograd_out[k], rtol=0, atol=0)
    if objective == "sum":  # each pixel's weight gradient is its input, for every output
        torch.testing.assert_close(
            closed_out["grad:weight"], x.reshape(3, 2, 1, 50).expand(3, 2, 4, 50), rtol=0, atol=0
        )


def test_closed_form_only_for_gridsolves_own_model_and_parameter_gradients() -> None:
    from gridsolve.stages.model.per_sample import _closed_form

    cfg = MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4)
    assert _closed_form(_ReweightedLinear(3, 2, 4), cfg) is None  # its forward is not the rule's
    for wrt in ("input", "both"):
        assert _closed_form(build_module(cfg), cfg.model_copy(update={"wrt": wrt})) is None


def test_builtin_model_mse_gradients_equal_autograd_loop(chain: Chain, write_cube: Any) -> None:
    # the built-in model takes its closed form: checked here against the loop, not itself
    ds = make_ds(n_obs=12, ny=4, nx=5)
    target = np.random.default_rng(4).standard_normal((4, 4, 5))
    ds["t"] = (("out", "y", "x"), target)
    cfg = MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4, objective="mse")
    out = run_model(chain, write_cube(ds), cfg, variable="signal", target="t")
    X, T = pixels(out["coefficients"]).reshape(-1, 3, 2), pixels(target)
    module = build_module(cfg)
    for p in range(20):
        y = module(torch.from_numpy(X[p]))
        loss = ((y - torch.from_numpy(T[p]).float()) ** 2).mean()
        w, b = torch.autograd.grad(loss, [module.weight, module.bias])
        np.testing.assert_allclose(pixels(out["grad:weight"])[p], w.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(pixels(out["grad:bias"])[p], b.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(pixels(out["prediction"])[p], y.detach().numpy(), rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_closed_form_finite_flags_are_those_of_the_outputs(dtype: str) -> None:
    from gridsolve.stages.model.compiled import _finite_pixels
    from gridsolve.stages.model.per_sample import _closed_form

    cfg = MultidimLinearModel(input_dim=3, hidden_dim=2, output_dim=4, objective="mse", dtype=dtype)
    module = build_module(cfg).to(getattr(torch, dtype))
    params = {k: v.detach() for k, v in module.named_parameters()}
    big = float(np.sqrt(np.finfo(dtype).max))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 40, generator=gen, dtype=module.weight.dtype)
    t = torch.randn(4, 40, generator=gen, dtype=x.dtype)
    x[0, 2] = big * 4  # y and dl large, their product inf
    t[:, 3] = big * 8  # dl ≈ big, x ordinary: finite
    t[2, 4] = np.nan  # dl NaN for one output: NaN gradients
    x[:, 5] = 0.0
    t[:, 5] = -float(np.finfo(dtype).max) / 8  # dl huge but finite, x = 0: zeros
    shapes = {"prediction": (4,), "grad:weight": (3, 2, 4), "grad:bias": (4,)}
    outputs = {k: torch.empty((*s, 40), dtype=x.dtype) for k, s in shapes.items()}
    closed = _closed_form(module, cfg)
    assert closed is not None
    flags = closed(params, {}, x.t().contiguous().reshape(40, 3, 2), x, t.t(), outputs)
    want = _finite_pixels(o.numpy() for o in outputs.values())
    np.testing.assert_array_equal(flags.numpy(), want)
    assert list(np.flatnonzero(~want)) == [2, 4]


@pytest.mark.parametrize(("objective", "dtype"), [("sum", "float32"), ("mse", "float64")])
def test_rows_written_whole_equal_the_autograd_chunks(
    mappable_tmp: Path,
    chain: Chain,
    write_cube: Any,
    monkeypatch: pytest.MonkeyPatch,
    objective: str,
    dtype: str,
) -> None:
    # A dense tile of the built-in model is written whole rows at a time into the store's
    # files; a few pixels without coefficients, and (mse) one without a finite target.
    from gridsolve.stages.model import chunk_kernel, tile_run

    ds = make_ds(n_obs=12, ny=5, nx=6)
    ds["signal"].values[:, 0, :2] = np.nan
    target = np.random.default_rng(6).standard_normal((4, 5, 6))
    target[1, 4, 5] = np.nan
    ds["t"] = (("out", "y", "x"), target)
    cfg = MultidimLinearModel(
        input_dim=2, hidden_dim=3, output_dim=4, objective=objective, dtype=dtype
    )
    load = {"variable": "signal", **({"target": "t"} if objective == "mse" else {})}
    rows_run: list[bool] = []
    run_rows = tile_run._run_rows
    monkeypatch.setattr(
        "gridsolve.stages.model.vmapped._run_rows",
        lambda *a: rows_run.append(True) or run_rows(*a),
    )
    chunks_run: list[bool] = []
    run_chunks = tile_run._run_chunks
    monkeypatch.setattr(
        "gridsolve.stages.model.vmapped._run_chunks",
        lambda *a: chunks_run.append(True) or run_chunks(*a),
    )
    got = run_model(chain, write_cube(ds), cfg, **load)
    assert rows_run == [True] and chunks_run == []
    monkeypatch.setattr(tile_run, "_closed_form", lambda *a: None)
    monkeypatch.setattr(chunk_kernel, "_closed_form", lambda *a: None)
    import dataclasses

    from gridsolve.stages.engine.store import Store

    fresh = dataclasses.replace(chain.ctx, store=Store(mappable_tmp / "autograd"))  # no hits
    want = run_model(Chain(fresh), write_cube(ds), cfg, **load)
    assert rows_run == [True] and chunks_run == [True]  # autograd, chunk by chunk
    assert sorted(got) == sorted(want)
    for k in got:
        assert got[k].tobytes() == want[k].tobytes(), k
    status = got["model_status"]
    assert (status[0, :2] == MODEL_STATUS_CODES["input_not_finite"]).all()
    assert np.isnan(got["grad:weight"][..., 0, :2]).all()
    if objective == "mse":
        assert status[4, 5] == MODEL_STATUS_CODES["target_not_finite"]
        assert np.isnan(got["grad:bias"][:, 4, 5]).all()
        assert np.isfinite(got["prediction"][:, 4, 5]).all()
