"""A user's single-sample model living outside gridsolve's packages."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    """x (n_in,) → tanh(W1 x + b1) → W2 · + b2 → (n_out,), for ONE sample."""

    def __init__(self, n_in: int, hidden: int = 5, n_out: int = 2) -> None:
        super().__init__()
        self.layer1 = nn.Linear(n_in, hidden)
        self.layer2 = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.tanh(self.layer1(x)))


class Batched(nn.Module):
    """A model that (wrongly) assumes a batch dim: fails on one sample."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0, 0] * self.w.sum()


class Scaled(nn.Module):
    """A linear layer whose outputs are multiplied by a buffer ``scale`` (1 when constructed)."""

    def __init__(self, n_in: int = 6, n_out: int = 2) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class IntBufferFirst(nn.Module):
    """The first state-dict entry is an integer buffer, the float weights come after it."""

    def __init__(self, n_in: int = 6, n_out: int = 2) -> None:
        super().__init__()
        self.register_buffer("offset", torch.tensor(2, dtype=torch.int64))
        self.lin = nn.Linear(n_in, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.offset


class WithBatchNorm(nn.Module):
    """Linear → BatchNorm1d → tanh → Linear for ONE sample (BatchNorm sees a batch of one)."""

    def __init__(self, n_in: int = 6, hidden: int = 4, n_out: int = 2) -> None:
        super().__init__()
        self.lin1 = nn.Linear(n_in, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.lin2 = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.lin1(x).unsqueeze(0)).squeeze(0)
        return self.lin2(torch.tanh(h))


class WithDropout(nn.Module):
    """Linear → Dropout → Linear."""

    def __init__(self, n_in: int = 6, hidden: int = 4, n_out: int = 2) -> None:
        super().__init__()
        self.lin1 = nn.Linear(n_in, hidden)
        self.drop = nn.Dropout(0.5)
        self.lin2 = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.drop(torch.tanh(self.lin1(x))))


class ItemForward(nn.Module):
    """Works on one sample, but vmap cannot batch ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (1.0 + abs(x[0].item()))


class BranchOnValue(nn.Module):
    """Python control flow on a tensor value: fine on one sample, not under vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:
            return h
        return -h


class CountsCalls(nn.Module):
    """Modifies a buffer in place in forward: state carried from one pixel to the next."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


class TupleOut(nn.Module):
    """Returns a tuple of two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h.sum()


class DictOut(nn.Module):
    """Returns a dict of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.lin(x)
        return {"h": h, "total": h.sum()}


class LogOutput(nn.Module):
    """log of a linear layer: NaN wherever the layer's output is negative."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.lin(x))


class InPlaceBias(nn.Module):
    """Copies its bias into a fresh tensor in place: vmap batches that over pixels, but not
    over per-pixel copies of the parameters (a batched value into an unbatched tensor)."""

    def __init__(self, n_in: int = 6, n_out: int = 2) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out, bias=False)
        self.b = nn.Parameter(torch.linspace(-1.0, 1.0, n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros(self.b.shape, dtype=x.dtype)
        bias.copy_(self.b)
        return self.lin(x) + bias
