"""The train stage's numerics: per-sample clipped (DP-)SGD against independent oracles.

Oracles: a per-sample autograd loop (one ``.backward()`` per sample on a deep
copy, then torch's own optimiser), Opacus's GradSampleModule/DPOptimizer on a
hand-batched equivalent model, and Opacus's RDP accountant called directly.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.kinds.load import DemoLoad, NetCDFLoad
from gridsolve.schemas.kinds.train import AdamTrain, GradientTrain, NoTrain, SGDTrain
from gridsolve.stages.model.multidim_linear import MultidimLinear
from gridsolve.stages.train import dpsgd
from gridsolve.stages.train.clipped_step import dp_step
from gridsolve.stages.train.sampling import block_split, epoch_batches, epsilon, privacy_spent
from gridsolve.stages.train.train_state import (
    TrainResult,
    TrainState,
    state_from_arrays,
    state_to_arrays,
)

import my_models

SHAPE = (3, 4)
N_OUT = 2


def data(n: int, seed: int = 0, scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *SHAPE))
    y = scale * rng.normal(size=(n, N_OUT))
    return x, y


def fetcher(x: np.ndarray, y: np.ndarray) -> dpsgd.Fetch:
    return lambda idx: (x[idx], y[idx])


def linear_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MultidimLinear(*SHAPE, N_OUT).double()


def mlp_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return my_models.TinyMLP(n_in=SHAPE[0] * SHAPE[1], hidden=5, n_out=N_OUT).double()


class FlatInput(nn.Module):
    """A (3, 4) sample fed to a module that takes the flattened (12,) sample."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x.reshape(-1))
        return out


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def torch_optimizer(config: GradientTrain, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimiser the config describes, written out here independently of the code."""
    if isinstance(config, SGDTrain):
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    assert isinstance(config, AdamTrain)
    return torch.optim.Adam(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )


def oracle(
    module: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    batches: Sequence[np.ndarray],
    config: GradientTrain,
    divisor: Callable[[np.ndarray], int] = len,
) -> dict[str, torch.Tensor]:
    """Per-sample loop: a fresh .backward() per sample on a deep copy, clip, sum, /B, step."""
    model = copy.deepcopy(module)
    opt = torch_optimizer(config, list(model.parameters()))
    for idx in batches:
        summed = [torch.zeros_like(p) for p in model.parameters()]
        for i in idx:
            one = copy.deepcopy(model)
            out = one(torch.as_tensor(x[i]))
            loss = ((out - torch.as_tensor(y[i])) ** 2).mean()
            loss.backward()
            g = [p.grad for p in one.parameters()]
            assert all(gi is not None for gi in g)
            norm = math.sqrt(sum(float((gi**2).sum()) for gi in g if gi is not None))
            factor = 1.0 if config.clip_norm is None else min(1.0, config.clip_norm / (norm + 1e-6))
            summed = [s + factor * gi for s, gi in zip(summed, g, strict=True) if gi is not None]
        for p, s in zip(model.parameters(), summed, strict=True):
            p.grad = s / divisor(idx)
        opt.step()
    return params_of(model)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        scale = float(b[k].abs().max())
        err = float((a[k] - b[k]).abs().max())
        assert err <= rtol * scale, f"{k}: max abs error {err:.3g} vs scale {scale:.3g}"


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype
        assert a[k].numpy().tobytes() == b[k].numpy().tobytes(), k


CONFIGS = [
    # clip_norm near the median per-sample norm of the data below: some samples are clipped.
    SGDTrain(epochs=3, batch_pixels=64, lr=0.1, momentum=0.9, clip_norm=10, validation_fraction=0),
    AdamTrain(epochs=3, batch_pixels=64, lr=0.05, clip_norm=10, validation_fraction=0),
]


# ---------------------------------------------------------------- against the per-sample loop
@pytest.mark.parametrize("config", CONFIGS, ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("make", [linear_model, mlp_model], ids=["multidim_linear", "two_layer"])
def test_full_batch_steps_match_per_sample_loop(
    config: GradientTrain, make: Callable[[int], nn.Module]
) -> None:
    n = 40  # batch_pixels ≥ N: every epoch is one full-batch step
    x, y = data(n)
    module = make(0)
    shape = None if make is linear_model else (SHAPE[0] * SHAPE[1],)
    # Clip at the median initial norm, so that about half the samples are clipped.
    leaves = params_of(module)
    xt = torch.as_tensor(x).reshape(n, *(shape or SHAPE))
    norms = dp_step(
        module, leaves, torch.optim.SGD(list(leaves.values()), lr=0.0), xt, torch.as_tensor(y),
        clip_norm=None,
    ).norms  # fmt: skip
    config = config.model_copy(update={"clip_norm": float(norms.median())})
    res = dpsgd.train(module, params_of(module), fetcher(x, y), n, config, input_shape=shape)
    hist = res.state.history
    assert [h["steps"] for h in hist] == [1, 1, 1]
    # Clipping is active for some samples and not for others.
    assert 0 < hist[0]["clipped_fraction"] < 1
    expected_module = module if make is linear_model else FlatInput(module)
    want = oracle(expected_module, x, y, [np.arange(n)] * 3, config)
    if make is not linear_model:
        want = {k.removeprefix("inner."): v for k, v in want.items()}
    assert_close(res.params, want, 1e-6)
    # The module passed in is left as it was.
    assert_identical(params_of(module), params_of(make(0)))


@pytest.mark.parametrize("config", CONFIGS, ids=["sgd-momentum", "adam"])
def test_minibatch_epochs_match_per_sample_loop(config: GradientTrain) -> None:
    n, b = 30, 8  # 4 steps per epoch, the last of 6 pixels
    cfg = config.model_copy(update={"batch_pixels": b, "epochs": 2, "seed": 5})
    x, y = data(n, seed=1)
    module = linear_model(1)
    res = dpsgd.train(module, params_of(module), fetcher(x, y), n, cfg)
    batches = [idx for e in (1, 2) for idx in epoch_batches(n, b, poisson=False, seed=5, epoch=e)]
    assert sorted(len(i) for i in batches) == [6, 6, 8, 8, 8, 8, 8, 8]
    # Each epoch visits every pixel once.
    assert sorted(np.concatenate(batches[:4]).tolist()) == list(range(n))
    assert all(0 < h["clipped_fraction"] < 1 for h in res.state.history)
    assert_close(res.params, oracle(module, x, y, batches, cfg), 1e-6)


def test_poisson_steps_divide_by_the_expected_batch_size() -> None:
    n, b = 50, 10
    # Noise small enough to vanish in the comparison, but > 0: Poisson sampling.
    cfg = SGDTrain(
        epochs=1, batch_pixels=b, lr=0.2, clip_norm=10.0, noise_multiplier=1e-12, seed=3,
        validation_fraction=0,
    )  # fmt: skip
    x, y = data(n, seed=2)
    module = linear_model(2)
    res = dpsgd.train(module, params_of(module), fetcher(x, y), n, cfg)
    batches = list(epoch_batches(n, b, poisson=True, seed=3, epoch=1))
    assert len(batches) == 5 and len({len(i) for i in batches}) > 1
    want = oracle(module, x, y, batches, cfg, divisor=lambda _: b)
    assert_close(res.params, want, 1e-6)
    wrong = oracle(module, x, y, batches, cfg, divisor=len)
    assert max(float((res.params[k] - wrong[k]).abs().max()) for k in want) > 1e-4


def test_clipping_is_per_sample() -> None:
    n, clip = 16, 0.5
    x, y = data(n, seed=4, scale=0.1)
    y[3] = 1e6  # one pixel with a huge target
    module = linear_model(4)

    def delta(idx: np.ndarray, divisor: int) -> dict[str, torch.Tensor]:
        leaves = params_of(module)
        opt = torch.optim.SGD(list(leaves.values()), lr=1.0)
        xt, yt = torch.as_tensor(x[idx]), torch.as_tensor(y[idx])
        dp_step(module, leaves, opt, xt, yt, clip_norm=clip, divisor=divisor)
        return {k: leaves[k] - v for k, v in params_of(module).items()}

    def norm(d: dict[str, torch.Tensor]) -> float:
        return math.sqrt(sum(float((v**2).sum()) for v in d.values()))

    with_big = delta(np.arange(n), n)
    without = delta(np.delete(np.arange(n), 3), n)
    contribution = norm({k: with_big[k] - without[k] for k in with_big})
    assert contribution <= clip / n * (1 + 1e-9)
    assert contribution > 0.99 * clip / n  # clipped to the bound, not dropped
    # Clipping the batch gradient instead (backward on the batch mean) is another update.
    naive = copy.deepcopy(module)
    out = torch.stack([naive(xi) for xi in torch.as_tensor(x)])
    ((out - torch.as_tensor(y)) ** 2).mean().backward()
    naive_step = {k: -p.grad for k, p in naive.named_parameters() if p.grad is not None}
    assert norm(naive_step) > 1000 * norm(with_big)


def test_step_reports_per_sample_norms_before_clipping() -> None:
    n = 6
    x, y = data(n, seed=7)
    module = linear_model(7)
    leaves = params_of(module)
    opt = torch.optim.SGD(list(leaves.values()), lr=0.0)
    stats = dp_step(module, leaves, opt, torch.as_tensor(x), torch.as_tensor(y), clip_norm=1e-3)
    for i in range(n):
        one = copy.deepcopy(module)
        out = one(torch.as_tensor(x[i]))
        loss = ((out - torch.as_tensor(y[i])) ** 2).mean()
        loss.backward()
        norm = math.sqrt(
            sum(float((p.grad**2).sum()) for p in one.parameters() if p.grad is not None)
        )
        assert stats.norms[i].item() == pytest.approx(norm, rel=1e-10)
        assert stats.losses[i].item() == pytest.approx(loss.item(), rel=1e-10)


def test_noise_is_gaussian_with_std_multiplier_times_clip_over_divisor() -> None:
    big = nn.Linear(100, 50).double()
    leaves = params_of(big)
    opt = torch.optim.SGD(list(leaves.values()), lr=1.0)
    empty = torch.zeros(0, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    dp_step(
        big, leaves, opt, empty, empty, clip_norm=2.0, noise_multiplier=1.5, divisor=4,
        generator=gen,
    )  # fmt: skip
    step = torch.cat([(leaves[k] - v).reshape(-1) for k, v in params_of(big).items()])
    z = -step * 4 / (1.5 * 2.0)
    assert abs(float(z.mean())) < 0.05
    assert float(z.std()) == pytest.approx(1.0, abs=0.03)


# ---------------------------------------------------------------- against Opacus
@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("config", CONFIGS, ids=["sgd-momentum", "adam"])
def test_matches_opacus_dpoptimizer(config: GradientTrain) -> None:
    pytest.importorskip("opacus")
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    n, b, epochs = 48, 16, 2
    cfg = config.model_copy(update={"batch_pixels": b, "epochs": epochs, "seed": 11})
    x, y = data(n, seed=3)
    module = linear_model(3)
    res = dpsgd.train(module, params_of(module), fetcher(x, y), n, cfg)
    assert all(0 < h["clipped_fraction"] < 1 for h in res.state.history)

    # The same model written batched: tensordot(x, W, dims=2) + b == Linear on flattened x.
    lin = nn.Linear(SHAPE[0] * SHAPE[1], N_OUT).double()
    with torch.no_grad():
        init = params_of(module)
        lin.weight.copy_(init["weight"].reshape(-1, N_OUT).t())
        lin.bias.copy_(init["bias"])
    gsm = GradSampleModule(lin, loss_reduction="mean")
    opt = DPOptimizer(
        torch_optimizer(cfg, list(gsm.parameters())),
        noise_multiplier=0.0,
        max_grad_norm=cfg.clip_norm,
        expected_batch_size=b,
        loss_reduction="mean",
    )
    xs, ys = torch.as_tensor(x.reshape(n, -1)), torch.as_tensor(y)
    for e in range(1, epochs + 1):
        for idx in epoch_batches(n, b, poisson=False, seed=11, epoch=e):
            opt.zero_grad()
            loss: torch.Tensor = nn.functional.mse_loss(gsm(xs[idx]), ys[idx])
            loss.backward()
            opt.step()
    want = {
        "weight": lin.weight.detach().t().reshape(*SHAPE, N_OUT),
        "bias": lin.bias.detach(),
    }
    assert_close(res.params, want, 1e-6)


# ---------------------------------------------------------------- resuming and determinism
RESUME = [
    SGDTrain(epochs=3, batch_pixels=8, lr=0.05, momentum=0.9, validation_fraction=0.2, seed=2),
    AdamTrain(
        epochs=3, batch_pixels=8, lr=0.05, noise_multiplier=0.8, early_stopping=5, seed=2,
        validation_fraction=0.2,
    ),
]  # fmt: skip


@pytest.mark.parametrize("config", RESUME, ids=["sgd-shuffled", "adam-dp-poisson"])
def test_resume_after_an_epoch_is_byte_identical(config: GradientTrain) -> None:
    x, y = data(40, seed=5)
    xv, yv = data(10, seed=6)
    val = (fetcher(xv, yv), 10)
    straight = dpsgd.train(
        linear_model(5), params_of(linear_model(5)), fetcher(x, y), 40, config, validation=val
    )

    snapshots: list[TrainState] = []
    first = dpsgd.train(
        linear_model(5), params_of(linear_model(5)), fetcher(x, y), 40, config,
        validation=val, until_epoch=1, on_epoch=snapshots.append,
    )  # fmt: skip
    assert first.state.epoch == 1 and len(snapshots) == 1
    arrays, meta = state_to_arrays(snapshots[0])
    meta = json.loads(json.dumps(meta))  # stored as JSON
    arrays = {k: np.array(v) for k, v in arrays.items()}
    restored = state_from_arrays(arrays, meta)
    fresh = linear_model(99)  # another initialisation: the state's weights are used
    resumed = dpsgd.train(
        fresh, params_of(fresh), fetcher(x, y), 40, config, validation=val, state=restored
    )
    assert_identical(resumed.params, straight.params)
    assert_identical(resumed.state.params, straight.state.params)
    assert resumed.state.history == straight.state.history
    assert resumed.state.steps == straight.state.steps
    # Training did something, and the recorded validation loss is the loss of the weights.
    assert not torch.equal(straight.params["weight"], params_of(linear_model(5))["weight"])
    if config.early_stopping is None:
        vl = dpsgd.mean_loss(linear_model(5), straight.params, val[0], 10, 3)
        assert vl == pytest.approx(straight.state.history[-1]["val_loss"], rel=1e-12)


def test_noise_and_seed_change_results_and_runs_repeat() -> None:
    x, y = data(40, seed=8)

    def run(**update: Any) -> dict[str, torch.Tensor]:
        cfg = SGDTrain(epochs=2, batch_pixels=8, lr=0.1, validation_fraction=0).model_copy(
            update=update
        )
        m = linear_model(8)
        return dpsgd.train(m, params_of(m), fetcher(x, y), 40, cfg).params

    a, b = run(noise_multiplier=1.0), run(noise_multiplier=1.0)
    assert_identical(a, b)
    assert not torch.equal(a["weight"], run(noise_multiplier=1.0, seed=1)["weight"])
    assert not torch.equal(a["weight"], run()["weight"])
    assert not torch.equal(run()["weight"], run(seed=1)["weight"])


def test_results_do_not_depend_on_how_fetch_reads() -> None:
    x, y = data(50, seed=9)
    xv, yv = data(13, seed=10)
    cfg = AdamTrain(epochs=2, batch_pixels=7, lr=0.05, noise_multiplier=0.5, early_stopping=1)

    def pieces(xa: np.ndarray, ya: np.ndarray, size: int) -> dpsgd.Fetch:
        def fetch(idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            parts = [idx[i : i + size] for i in range(0, len(idx), size)]
            return (
                torch.cat([torch.as_tensor(xa[p]) for p in parts]),
                torch.cat([torch.as_tensor(ya[p]).reshape(len(p), -1) for p in parts]),
            )

        return fetch

    def run(fetch: dpsgd.Fetch, vfetch: dpsgd.Fetch) -> TrainResult:
        m = linear_model(9)
        return dpsgd.train(m, params_of(m), fetch, 50, cfg, validation=(vfetch, 13))

    ref = run(fetcher(x, y), fetcher(xv, yv))
    for size in (1, 3, 64):
        other = run(pieces(x, y, size), pieces(xv, yv, size))
        assert_identical(other.params, ref.params)
        assert other.state.history == ref.state.history


def test_early_stopping_keeps_the_best_epoch() -> None:
    rng = np.random.default_rng(11)
    w = rng.normal(size=(*SHAPE, N_OUT))
    x, xv = rng.normal(size=(40, *SHAPE)), rng.normal(size=(10, *SHAPE))
    y = np.tensordot(x, w, axes=2)
    yv = -np.tensordot(xv, w, axes=2)  # fitting the training pixels worsens validation
    cfg = SGDTrain(epochs=10, batch_pixels=40, lr=0.1, clip_norm=None, early_stopping=2)
    m = linear_model(11)
    snaps: list[TrainState] = []
    res = dpsgd.train(
        m, params_of(m), fetcher(x, y), 40, cfg, validation=(fetcher(xv, yv), 10),
        on_epoch=snaps.append,
    )  # fmt: skip
    hist = res.state.history
    assert [h["epoch"] for h in hist] == [1, 2, 3]
    assert hist[0]["val_loss"] < hist[1]["val_loss"] < hist[2]["val_loss"]
    assert hist[0]["train_loss"] > hist[2]["train_loss"]
    assert res.state.stopped and res.state.best_epoch == 1
    assert_identical(res.params, snaps[0].params)
    assert not torch.equal(res.params["weight"], res.state.params["weight"])
    # A stopped state stays stopped when resumed.
    again = dpsgd.train(
        m, params_of(m), fetcher(x, y), 40, cfg, validation=(fetcher(xv, yv), 10),
        state=res.state,
    )  # fmt: skip
    assert again.state.epoch == 3
    assert_identical(again.params, res.params)


# ---------------------------------------------------------------- refused layers
def test_train_mode_batchnorm_and_dropout_are_refused() -> None:
    x, y = data(12, seed=13)
    cfg = SGDTrain(epochs=1, batch_pixels=4, validation_fraction=0)
    shape = (SHAPE[0] * SHAPE[1],)
    for model, word in ((my_models.WithBatchNorm(n_in=12), "BatchNorm"),
                        (my_models.WithDropout(n_in=12), "Dropout")):  # fmt: skip
        model = model.double().train()
        with pytest.raises(ConfigError, match=word) as err:
            dpsgd.train(model, params_of(model), fetcher(x, y), 12, cfg, input_shape=shape)
        assert "model.mode: eval" in str(err.value)
        model.eval()
        res = dpsgd.train(model, params_of(model), fetcher(x, y), 12, cfg, input_shape=shape)
        assert all(torch.isfinite(v).all() for v in res.params.values())


# ---------------------------------------------------------------- validation split
def test_block_split_whole_blocks_fraction_and_seed() -> None:
    ny, nx = 200, 163
    mask = block_split(ny, nx, 0.2, seed=4)
    assert mask.shape == (ny, nx) and mask.dtype == bool
    nby, nbx = -(-ny // 8), -(-nx // 8)
    padded = np.zeros((nby * 8, nbx * 8), bool)
    padded[:ny, :nx] = mask
    blocks = padded.reshape(nby, 8, nbx, 8).transpose(0, 2, 1, 3).reshape(nby, nbx, 64)
    whole = blocks[:, :, 0]
    for by in range(nby):
        for bx in range(nbx):
            cells = mask[by * 8 : (by + 1) * 8, bx * 8 : (bx + 1) * 8]
            assert (cells == whole[by, bx]).all()
    assert whole.sum() == round(0.2 * nby * nbx)
    assert 0.15 < mask.mean() < 0.25
    assert (block_split(ny, nx, 0.2, seed=4) == mask).all()
    assert (block_split(ny, nx, 0.2, seed=5) != mask).any()
    assert not block_split(ny, nx, 0.0, seed=4).any()
    # A tiny grid still gets a validation block, and keeps one for training.
    small = block_split(9, 9, 0.1, seed=0)
    assert 0 < small.sum() < 81


# ---------------------------------------------------------------- privacy accounting
def test_epsilon_matches_opacus_and_a_published_value() -> None:
    pytest.importorskip("opacus")
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(300):
        acc.step(noise_multiplier=1.1, sample_rate=0.01)
    assert epsilon(1.1, 0.01, 300, 1e-5) == pytest.approx(acc.get_epsilon(delta=1e-5))
    # Opacus's own accountant test: σ = 1.5, q = 0.04, 90 epochs, δ = 1e-5 → ε ≈ 7.32911117143.
    assert epsilon(1.5, 0.04, int(90 / 0.04), 1e-5) == pytest.approx(7.32911117143, abs=1e-7)


def test_epsilon_grows_with_steps_and_falls_with_noise() -> None:
    pytest.importorskip("opacus")
    by_steps = [epsilon(1.0, 0.01, s, 1e-5) for s in (10, 100, 1000)]
    assert by_steps == sorted(by_steps) and by_steps[0] < by_steps[-1]
    by_noise = [epsilon(s, 0.01, 1000, 1e-5) for s in (0.8, 1.0, 2.0)]
    assert by_noise == sorted(by_noise, reverse=True) and by_noise[0] > by_noise[-1]
    assert epsilon(1.0, 0.01, 0, 1e-5) == 0.0
    assert epsilon(0.0, 0.01, 10, 1e-5) == math.inf


def test_privacy_spent_of_a_run() -> None:
    pytest.importorskip("opacus")
    cfg = SGDTrain(batch_pixels=40, noise_multiplier=1.2)
    eps, delta = privacy_spent(cfg, 1000, 250)
    assert delta == 1e-3
    assert eps == epsilon(1.2, 0.04, 250, 1e-3)
    assert privacy_spent(cfg.model_copy(update={"delta": 1e-6}), 1000, 250)[1] == 1e-6
    assert privacy_spent(SGDTrain(), 1000, 250)[0] == math.inf


def test_epsilon_without_opacus_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opacus.accountants.analysis.rdp", None)
    with pytest.raises(ConfigError, match="pip install opacus"):
        epsilon(1.0, 0.01, 10, 1e-5)


# ---------------------------------------------------------------- config
def test_config_rules() -> None:
    with pytest.raises(ValidationError, match="set clip_norm"):
        SGDTrain(clip_norm=None, noise_multiplier=1.0)
    SGDTrain(clip_norm=None)  # no clipping without noise is fine
    with pytest.raises(ValidationError, match="extra"):
        AdamTrain.model_validate({"momentum": 0.9})
    with pytest.raises(ValidationError, match="extra"):
        NoTrain.model_validate({"epochs": 3})
    with pytest.raises(ValidationError, match="unknown solve status"):
        SGDTrain(usable_status=["ok", "nope"])
    with pytest.raises(ValidationError, match="validation_fraction"):
        SGDTrain(early_stopping=3, validation_fraction=0.0)
    with pytest.raises(ValidationError):
        SGDTrain(validation_fraction=0.6)
    cfg = AdamTrain.model_validate(
        {"betas": [0.8, 0.99], "usable_status": ["ok", "fell_back_to_ridge"]}
    )
    assert cfg.betas == (0.8, 0.99)
    assert cfg.key_payload()["usable_status"] == ["ok", "fell_back_to_ridge"]
    assert SGDTrain().epochs == 20 and SGDTrain().batch_pixels == 4096


def test_training_needs_a_target() -> None:
    for cfg in (SGDTrain(), AdamTrain()):
        problems = cfg.cross_stage({"load": DemoLoad(), "train": cfg})
        assert problems == [f"train impl {cfg.impl!r} needs a target: set load.target"]
        assert cfg.cross_stage({"load": NetCDFLoad(path="x.nc", target="t")}) == []
    assert NoTrain().cross_stage({"load": DemoLoad()}) == []
