"""Training with per-sample clipping: the train stage vs the peers, side by side in one run.

The problem: --pixels samples (default 250,000, the 500 × 500 seed grid), the 10×10×4
multidim linear model (``tensordot(x, W, 2) + b``, x of 10 × 10 coefficients), per-sample
MSE, clip_norm 1.0, no noise, 4096 pixels a step, SGD lr 0.01, float32, one epoch from the
same seeded weights on seeded random inputs and targets. Rows:

gridsolve  dpsgd.train (epochs 1, no validation) with the stage's fetch
           (stages/train/stage.fetcher) over the stage's row files (stage.Rows) of
           X (N, 100), Y (N, 4), warm in the page cache: the code path of the train
           stage, shuffle and batch reads included
opacus     Opacus 1.6 PrivacyEngine.make_private (noise_multiplier 0, max_grad_norm 1.0,
           poisson_sampling=False) on the model rewritten by hand as nn.Linear(100, 4),
           with the standard loop over a DataLoader(TensorDataset, batch_size 4096); the
           dataset is laid out in gridsolve's epoch-1 batch order so both see the same
           batches. Set-up (make_private, the DataLoader) is not timed.
           A second row times Opacus's compute alone (GradSampleModule + DPOptimizer on
           pre-sliced batch tensors, no DataLoader) to show where Opacus's time goes.
loop       a Python loop over pixels (forward, autograd.grad, clip, accumulate; a step per
           batch) on the unmodified model, timed on --loop-pixels and extrapolated to N

Timing: one warm-up each, then --repeats rounds in which the rows take turns (so a change of
load on a shared machine does not favour one row); medians. One torch thread by default
(--threads): on 2 cores shared with other work, two OpenMP threads stall on every parallel
op whenever a core is busy, and single epochs were seen to swing 10× (0.5 s to 8 s);
--threads 0 keeps torch's default.

Agreement: the weights after one epoch of gridsolve and of Opacus. make_private divides the
clipped sum by its expected batch size int(N / steps) (4032 for N = 250,000), gridsolve by
the actual batch size (4096; 144 for the last one), so the standard Opacus run differs by
that scale; an extra untimed Opacus epoch that sets optimizer.expected_batch_size to each
batch's size must agree to float32 rounding.

Memory: peak RSS of the train stage's streaming path, each size in a fresh subprocess: it
writes X (N, 100) float32 and Y (N, 4) through stage.Rows (as stage.dataset does, in
slices) in a temporary folder, then trains one epoch with stage.fetcher reading the
batches' rows. Rows maps the files only while one read or write copies its rows, so the
pages touched leave the process afterwards. Seed grid (500 × 500) vs a 16× grid
(2000 × 2000 with the default --rss-scale 4); the peak of the anonymous memory (RssAnon,
sampled every 5 ms) is reported beside the total (ru_maxrss), with the baseline after
imports and a 64-pixel warm-up epoch.

Targets: gridsolve ≤ 1.5× Opacus (judged against both Opacus rows); loop ≥ 100× gridsolve;
16× grid ≤ 1.3× the peak RSS (judged on the total and on the anonymous peak).
Peers come from the ``bench`` extra: ``pip install -e '.[bench]'``.

Usage: python benchmarks/bench_train.py [--pixels N] [--repeats R] [--loop-pixels P]
                                        [--rss-size S] [--rss-scale K] [--threads T]
                                        [--skip-rss]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import gridsolve.stages  # noqa: F401  (registers the built-in implementations)
from gridsolve.schemas.kinds.model import MultidimLinearModel
from gridsolve.schemas.kinds.train import SGDTrain
from gridsolve.stages.model import building
from gridsolve.stages.train import dpsgd
from gridsolve.stages.train.sampling import epoch_batches, steps_per_epoch
from gridsolve.stages.train.stage import Rows, fetcher
from gridsolve.stages.train.train_state import TrainResult

from common import machine, print_verdicts, table

BATCH = 4096
LR = 0.01
CLIP = 1.0
SHAPE = (10, 10)
N_OUT = 4


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def config() -> SGDTrain:
    return SGDTrain(
        epochs=1,
        batch_pixels=BATCH,
        lr=LR,
        clip_norm=CLIP,
        noise_multiplier=0.0,
        validation_fraction=0.0,
        seed=0,
    )


def model() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The stage's module (building.build_module, seed 0) and its initial parameters."""
    module = building.build_module(MultidimLinearModel(input_dim=10, hidden_dim=10, output_dim=4))
    return module, {k: v.detach().clone() for k, v in module.named_parameters()}


def data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded inputs (n, 100) — each row a 10 × 10 sample, as the stage stores them — and targets."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, *SHAPE), dtype=np.float32).reshape(n, -1)
    Y = rng.standard_normal((n, N_OUT), dtype=np.float32)
    return X, Y


def linear_rewrite(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """The multidim linear model as nn.Linear(100, 4): the hand rewrite the peers need."""
    lin = nn.Linear(100, 4)
    with torch.no_grad():
        lin.weight.copy_(weight.reshape(100, 4).T)
        lin.bias.copy_(bias)
    return lin


def as_multidim(lin: nn.Module) -> dict[str, torch.Tensor]:
    return {
        "weight": lin.weight.detach().T.reshape(*SHAPE, N_OUT).clone(),
        "bias": lin.bias.detach().clone(),
    }


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| over all parameters, relative to max |b|."""
    num = max(float((a[k] - b[k]).abs().max()) for k in b)
    den = max(float(b[k].abs().max()) for k in b)
    return num / den


# ---------------------------------------------------------------- speed
class OpacusRun:
    """make_private on the nn.Linear rewrite; one epoch per call of ``epoch``."""

    def __init__(
        self, params: dict[str, torch.Tensor], X: np.ndarray, Y: np.ndarray, order: np.ndarray
    ) -> None:
        self.params = params
        # gridsolve's epoch-1 batches, consecutive: shuffle=False then gives the same batches
        self.X = torch.from_numpy(X[order])
        self.Y = torch.from_numpy(Y[order])

    def setup(self) -> None:
        from opacus import PrivacyEngine

        model = linear_rewrite(self.params["weight"], self.params["bias"])
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(self.X, self.Y), batch_size=BATCH, shuffle=False
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model, self.optimizer, self.loader = PrivacyEngine().make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                data_loader=loader,
                noise_multiplier=0.0,
                max_grad_norm=CLIP,
                poisson_sampling=False,
            )
        self.criterion = nn.MSELoss()

    def epoch(self, actual_divisor: bool = False) -> None:
        for xb, yb in self.loader:
            if actual_divisor:  # gridsolve's rule without noise: divide by the batch's size
                self.optimizer.expected_batch_size = len(xb)
            self.optimizer.zero_grad()
            self.criterion(self.model(xb), yb).backward()
            self.optimizer.step()

    def weights(self) -> dict[str, torch.Tensor]:
        return as_multidim(self.model._module)


class OpacusCompute:
    """GradSampleModule + DPOptimizer by hand over pre-sliced batches (no DataLoader)."""

    def __init__(self, run: OpacusRun) -> None:
        self.run = run
        self.batches = [
            (run.X[s : s + BATCH], run.Y[s : s + BATCH]) for s in range(0, len(run.X), BATCH)
        ]

    def setup(self) -> None:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        model = linear_rewrite(self.run.params["weight"], self.run.params["bias"])
        self.model = GradSampleModule(model, loss_reduction="mean")
        self.optimizer = DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR),
            noise_multiplier=0.0,
            max_grad_norm=CLIP,
            expected_batch_size=BATCH,
            loss_reduction="mean",
        )
        self.criterion = nn.MSELoss()

    def epoch(self) -> None:
        for xb, yb in self.batches:
            self.optimizer.zero_grad()
            self.criterion(self.model(xb), yb).backward()
            self.optimizer.step()


def loop_epoch(
    module: nn.Module, params: dict[str, torch.Tensor], X: torch.Tensor, Y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-sample Python loop: forward, autograd.grad, clip, accumulate; a step per batch."""
    net = copy.deepcopy(module)
    with torch.no_grad():
        for k, v in net.named_parameters():
            v.copy_(params[k])
    leaves = list(net.parameters())
    opt = torch.optim.SGD(leaves, lr=LR)
    n = len(X)
    for start in range(0, n, BATCH):
        stop = min(n, start + BATCH)
        acc = [torch.zeros_like(v) for v in leaves]
        for i in range(start, stop):
            loss = ((net(X[i]) - Y[i]) ** 2).mean()
            grads = torch.autograd.grad(loss, leaves)
            norm = torch.sqrt(sum((g * g).sum() for g in grads))
            factor = (CLIP / (norm + 1e-6)).clamp(max=1.0)
            for a, g in zip(acc, grads, strict=True):
                a.add_(g, alpha=float(factor))
        for v, a in zip(leaves, acc, strict=True):
            v.grad = a / (stop - start)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in net.named_parameters()}


def interleaved(
    runs: dict[str, tuple[Callable[[], Any], Callable[[], None] | None]], repeats: int
) -> dict[str, float]:
    """Median seconds of each ``fn`` over ``repeats`` rounds, the rows taking turns in each round.

    One warm-up each first; ``setup`` (untimed) runs before every call. Taking turns keeps
    a change of load on a shared machine from favouring one row.
    """
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(repeats + 1):
        for name, (fn, setup) in runs.items():
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            if rnd:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def rows_of(folder: Path, X: np.ndarray, Y: np.ndarray) -> Rows:
    """The stage's row files holding X (flattened) and Y."""
    rows = Rows.create(folder, len(X), 100, N_OUT, np.dtype(np.float32))
    rows.write(np.arange(len(X)), X.reshape(len(X), -1), Y)
    return rows


def speed(n: int, repeats: int, loop_pixels: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gridsolve-bench-train-") as tmp:
        _speed(n, repeats, loop_pixels, Path(tmp))


def _speed(n: int, repeats: int, loop_pixels: int, folder: Path) -> None:
    module, params = model()
    X, Y = data(n)
    cfg = config()
    rows = rows_of(folder, X, Y)
    fetch = fetcher(rows, np.arange(n))
    order = np.concatenate(list(epoch_batches(n, BATCH, False, cfg.seed, 1)))
    op = OpacusRun(params, X, Y, order)
    oc = OpacusCompute(op)
    k = min(loop_pixels, n)
    Xt = torch.from_numpy(X[:k]).reshape(k, *SHAPE)
    Yt = torch.from_numpy(Y[:k])
    loop_w: dict[str, torch.Tensor] = {}

    def gridsolve() -> TrainResult:
        return dpsgd.train(module, params, fetch, n, cfg, input_shape=SHAPE)

    def loop() -> None:
        loop_w.update(loop_epoch(module, params, Xt, Yt))

    med = interleaved(
        {
            "gridsolve": (gridsolve, None),
            "opacus": (op.epoch, op.setup),
            "compute": (oc.epoch, oc.setup),
            "loop": (loop, None),
        },
        repeats,
    )
    grid_s, opacus_s, compute_s = med["gridsolve"], med["opacus"], med["compute"]
    loop_s = med["loop"] * n / k

    # ---- agreement of the weights after one epoch
    grid_w = gridsolve().params
    op.setup()
    op.epoch()
    op_std = rel_diff(op.weights(), grid_w)
    expected = op.optimizer.expected_batch_size
    op.setup()
    op.epoch(actual_divisor=True)
    op_same = rel_diff(op.weights(), grid_w)
    # the loop's k pixels through gridsolve: one shuffled epoch of the subset, same batches
    sub = dpsgd.train(module, params, fetcher(rows, np.arange(k)), k, cfg, input_shape=SHAPE)
    loop_agree = rel_diff(loop_w, sub.params) if k <= BATCH else float("nan")

    steps = steps_per_epoch(BATCH, n)
    print(
        f"\n## one epoch: {n:,} pixels, {steps} steps of {BATCH}, 10×10×4 model, "
        f"clip {CLIP}, noise 0, SGD lr {LR}, float32"
    )
    print(
        table(
            [
                ("gridsolve dpsgd.train", grid_s, "stage path: fetcher over the stage's row files"),
                (
                    "Opacus make_private",
                    opacus_s,
                    f"nn.Linear(100, 4) rewrite, DataLoader(TensorDataset), divisor {expected}",
                ),
                (
                    "Opacus compute only",
                    compute_s,
                    "GradSampleModule + DPOptimizer, pre-sliced batches, no DataLoader",
                ),
                (
                    "per-sample Python loop",
                    loop_s,
                    f"timed on {k:,} pixels, extrapolated ×{n / k:g}",
                ),
            ],
            opacus_s,
            "Opacus",
        )
    )
    print(
        "agreement (max|Δw| / max|w| after one epoch, vs gridsolve): "
        f"Opacus make_private {op_std:.1e} (its divisor {expected} vs gridsolve's actual batch "
        f"size); Opacus with divisor = batch size {op_same:.1e}; loop vs gridsolve on the "
        f"{k:,}-pixel subset {loop_agree:.1e}"
    )
    verdicts = [
        ("gridsolve / Opacus", grid_s / opacus_s, 1.5, "≤"),
        ("gridsolve / Opacus compute only", grid_s / compute_s, 1.5, "≤"),
        ("loop / gridsolve", loop_s / grid_s, 100.0, "≥"),
    ]
    print_verdicts(verdicts)


# ---------------------------------------------------------------- memory
def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in kB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0])
    return out


class Sampler(threading.Thread):
    """Peak RssAnon and RssFile, sampled every ``every`` seconds until stopped."""

    def __init__(self, every: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.every = every
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.halt = threading.Event()

    def sample(self) -> None:
        s = _status()
        for k in self.peak:
            self.peak[k] = max(self.peak[k], s[k])

    def run(self) -> None:
        while not self.halt.wait(self.every):
            self.sample()

    def stop(self) -> dict[str, int]:
        self.halt.set()
        self.join()
        self.sample()
        return self.peak


def rss_child(side: int) -> None:
    """One fresh process: row files like stage.dataset, one epoch like stage.run; JSON out."""
    n = side * side
    module, params = model()
    # warm-up on 64 in-memory pixels (torch's lazy start-up), so the baseline includes it
    Xw, Yw = data(64)
    with tempfile.TemporaryDirectory(prefix="gridsolve-bench-train-") as tmp:
        warm = fetcher(rows_of(Path(tmp), Xw, Yw), np.arange(64))
        dpsgd.train(module, params, warm, 64, config(), input_shape=SHAPE)
    base = _status()
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gridsolve-bench-train-") as tmp:
        folder = Path(tmp)
        rows = Rows.create(folder, n, 100, N_OUT, np.dtype(np.float32))
        rng = np.random.default_rng(0)
        for start in range(0, n, 2**16):  # written in slices, as the stage writes tile by tile
            stop = min(n, start + 2**16)
            rows.write(
                np.arange(start, stop),
                rng.standard_normal((stop - start, 100), dtype=np.float32),
                rng.standard_normal((stop - start, N_OUT), dtype=np.float32),
            )
        written = time.perf_counter() - t0
        after_write = _status()
        fetch = fetcher(rows, np.arange(n))
        fetch_s = 0.0

        def timed_fetch(idx: np.ndarray) -> tuple[Any, Any]:
            nonlocal fetch_s
            t = time.perf_counter()
            out = fetch(idx)
            fetch_s += time.perf_counter() - t
            return out

        minflt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t1 = time.perf_counter()
        result = dpsgd.train(module, params, timed_fetch, n, config(), input_shape=SHAPE)
        trained = time.perf_counter() - t1
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - minflt
        peak = sampler.stop()
        end = _status()
    print(
        json.dumps(
            {
                "side": side,
                "pixels": n,
                "base_rss_kb": base["VmRSS"],
                "base_anon_kb": base["RssAnon"],
                "after_write_rss_kb": after_write["VmRSS"],
                "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "hwm_kb": end["VmHWM"],
                "peak_anon_kb": peak["RssAnon"],
                "peak_file_kb": peak["RssFile"],
                "write_s": written,
                "train_s": trained,
                "fetch_s": fetch_s,
                "train_faults": faults,
                "loss": result.state.history[-1]["train_loss"],
            }
        )
    )


def memory(side: int, scale: int, threads: int) -> None:
    rows = []
    for s in (side, side * scale):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, __file__, "--rss-child", str(s), "--threads", str(threads)],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["wall_s"] = time.perf_counter() - t0
        rows.append(r)
    mb = 1024.0
    print(
        f"\n## peak RSS of the train stage's streaming path (row files, batch {BATCH}, 1 epoch), "
        "each in a fresh process"
    )
    print(
        f"{'grid':<12}{'pixels':>11}{'baseline':>10}{'peak RSS':>10}{'peak anon':>11}"
        f"{'peak file':>11}{'write s':>9}{'train s':>9}{'of it fetch':>13}{'faults':>9}"
    )
    for r in rows:
        grid = f"{r['side']}×{r['side']}"
        print(
            f"{grid:<12}{r['pixels']:>11,}{r['base_rss_kb'] / mb:>7.0f} MB"
            f"{r['maxrss_kb'] / mb:>7.0f} MB{r['peak_anon_kb'] / mb:>8.0f} MB"
            f"{r['peak_file_kb'] / mb:>8.0f} MB{r['write_s']:>9.1f}{r['train_s']:>9.1f}"
            f"{r['fetch_s']:>13.1f}{r['train_faults']:>9,}"
        )
    small, large = rows
    file_mb = large["pixels"] * (100 + N_OUT) * 4 / 2**20
    print(
        "baseline = VmRSS after imports and a 64-pixel warm-up epoch; "
        "peak RSS = ru_maxrss (whole process: writing the row files and the epoch). The files "
        f"({file_mb:,.0f} MB of X+Y on the larger grid) are mapped only while one read or "
        "write copies its rows, so their pages count in RSS only for that moment. "
        "peak file = RssFile sampled every 5 ms. peak anon = RssAnon sampled every "
        "5 ms (the process's own memory: torch, batches, per-sample gradients, index arrays). "
        "train s: the epoch (dpsgd.train); of it fetch: time inside stage.fetcher; faults: minor page "
        "faults during the epoch."
    )
    verdicts = [
        ("peak RSS, larger / smaller", large["maxrss_kb"] / small["maxrss_kb"]),
        ("peak anon RSS, larger / smaller", large["peak_anon_kb"] / small["peak_anon_kb"]),
        (
            "peak anon above imports, larger / smaller",
            (large["peak_anon_kb"] - large["base_anon_kb"])
            / max(1, small["peak_anon_kb"] - small["base_anon_kb"]),
        ),
    ]
    ratio = large["pixels"] / small["pixels"]
    for name, value in verdicts[:2]:
        print(
            f"{name} ({ratio:g}× pixels) = {value:.2f}× (target ≤ 1.3×: {'met' if value <= 1.3 else 'NOT met'})"
        )
    name, value = verdicts[2]
    print(f"{name} = {value:.2f}× (for information)")
    print(
        f"train time, larger / smaller = {large['train_s'] / small['train_s']:.1f}× "
        f"for {ratio:g}× pixels"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pixels", type=int, default=250_000, help="samples of the speed comparison")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loop-pixels", type=int, default=2000)
    p.add_argument("--rss-size", type=int, default=500, help="smaller grid is size × size")
    p.add_argument("--rss-scale", type=int, default=4, help="larger grid is (scale·size)²")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1, see above; 0: torch's default)",
    )
    p.add_argument("--skip-rss", action="store_true", help="speed comparison only")
    p.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # Opacus's hooks warn on every backward that the (non-leaf) inputs need no gradient
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    if args.rss_child is not None:
        rss_child(args.rss_child)
        return
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{machine()} · {cpu_model()} · load average at start {load}")
    t0 = time.perf_counter()
    speed(args.pixels, args.repeats, args.loop_pixels)
    if not args.skip_rss:
        memory(args.rss_size, args.rss_scale, args.threads)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
