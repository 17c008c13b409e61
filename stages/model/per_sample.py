"""The per-sample functions: the model's forward, gradients and Jacobians, vmapped over pixels.

The model is written for one sample and batched unchanged with
``torch.func.vmap`` over ``functional_call``; per-sample Jacobians come from
``vmap(jacrev(f))``. Per-sample gradients come two ways, with the same values:

* eager: the forward vmapped over the pixels *and* over a stride-0 copy of the
  parameters per pixel, then one plain ``torch.autograd.grad`` of the summed
  objective with respect to those copies (and the input). Pixel i's output depends
  only on copy i, so the gradient with respect to copy i is pixel i's gradient.
  Nothing of ``torch.func``'s reverse mode runs, so ``torch._dynamo`` (1.1–1.6 s to
  import, on the first ``vjp``/``grad``) is never imported: that import was most of
  a small run's model stage (issue 29);
* compiled (traced by dynamo): ``vmap(vjp)`` as a vector-Jacobian product, which
  inductor fuses into whole-chunk kernels.

A model whose forward vmap cannot batch over per-pixel parameters (an operator
without a batching rule for a batched weight) falls back to ``vmap(vjp)`` in eager
mode too, the first time it fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp, vmap

from gridsolve.schemas.kinds.model import ModelConfig
from gridsolve.stages.engine.timing import torch_func_ready
from gridsolve.stages.model.multidim_linear import MultidimLinear

log = logging.getLogger("gridsolve")


def _single_sample_fns(
    module: nn.Module, config: ModelConfig
) -> tuple[
    Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
    Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
]:
    """One sample's flat outputs, ``f(params, buffers, x)``, and its objective, ``loss(y, t)``."""

    def f(
        params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        out: torch.Tensor = functional_call(module, (params, buffers), (x,))
        return out.reshape(-1)

    def loss(y: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        if config.objective == "mse":
            assert t is not None
            return ((y - t) ** 2).mean()
        return y.sum()

    return f, loss


def _per_sample_fns(
    module: nn.Module, config: ModelConfig
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any] | None]:
    """(outputs, gradients, jacobians) functions of (params, buffers, x[, target]), vmapped.

    The gradients function returns ``(gradients, outputs)``: the outputs come
    from the same forward pass. Only the parameters (and the input) are
    differentiated; buffers are constants.
    """
    f, loss = _single_sample_fns(module, config)

    def gradients(
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        t: torch.Tensor | None,
    ) -> tuple[Any, torch.Tensor]:
        # The chain rule as autograd applies it to loss(f(x)): d loss/d y first, then
        # f's vector-Jacobian product. The gradient of a sum is an expanded (stride 0)
        # tensor; materialised (clone), vmap batches f's backward as whole-chunk products
        # instead of a loop over the pixels (3-4× faster, same values).
        if config.wrt == "params":
            res = vjp(lambda p: f(p, buffers, x), params)
        elif config.wrt == "input":
            res = vjp(lambda x_: f(params, buffers, x_), x)
        else:
            res = vjp(lambda p, x_: f(p, buffers, x_), params, x)
        y, pull = res[0], res[1]
        g = pull(grad(loss)(y, t).clone())
        return (g[0] if len(g) == 1 else g), y

    argnums: int | tuple[int, ...] = (
        0 if config.wrt == "params" else 2 if config.wrt == "input" else (0, 2)
    )
    t_dim = 0 if config.objective == "mse" else None
    outputs = vmap(f, in_dims=(None, None, 0))
    grads = _eager_or_vjp(
        _expanded_gradients(f, vmap(loss, in_dims=(0, t_dim)), config),
        vmap(gradients, in_dims=(None, None, 0, t_dim)),
    )
    jac = vmap(jacrev(f, argnums=argnums), in_dims=(None, None, 0)) if config.jacobian else None
    return outputs, grads, jac


#: (params, buffers, x, target) → (gradients as grad/vjp return them for ``wrt``, outputs)
Gradients = Callable[
    [dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None],
    tuple[Any, torch.Tensor],
]


def _expanded_gradients(
    f: Callable[..., torch.Tensor], losses: Callable[..., torch.Tensor], config: ModelConfig
) -> Gradients:
    """Per-sample gradients from one backward through per-pixel (stride-0) parameter copies.

    ``losses``: the objective vmapped over the pixels, (outputs, target) → (pixel,).
    """

    def expanded(
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        t: torch.Tensor | None,
    ) -> tuple[Any, torch.Tensor]:
        n = x.shape[0]
        with torch.enable_grad():
            p_in = params
            if config.wrt != "input":
                p_in = {
                    k: v.detach().expand(n, *v.shape).requires_grad_() for k, v in params.items()
                }
            x_in = x.detach().requires_grad_() if config.wrt != "params" else x
            p_dim = None if config.wrt == "input" else 0
            y = vmap(f, in_dims=(p_dim, None, 0))(p_in, buffers, x_in)
            # d loss/d y per pixel, then one backward of Σ (y · dl/dy): its gradient with
            # respect to y is dl/dy exactly. A scalar root: autograd.grad with grad_outputs
            # imports sympy (0.4 s) for a shape check.
            y_d = y.detach().requires_grad_()
            (dl,) = torch.autograd.grad(losses(y_d, t).sum(), y_d)
            wanted = list(p_in.values()) if config.wrt != "input" else []
            if config.wrt != "params":
                wanted.append(x_in)
            # a parameter (or an input) the output does not use has a zero gradient, as
            # vmap(vjp) gives it
            found = torch.autograd.grad(
                (y * dl).sum(), wanted, allow_unused=True, materialize_grads=True
            )
        if config.wrt == "input":
            return found[-1], y.detach()
        by_param = dict(zip(p_in, found[: len(p_in)], strict=True))
        return (by_param if config.wrt == "params" else (by_param, found[-1])), y.detach()

    return expanded


#: ``write(array, index, block)``: ``array[index] = block``, the way the stage context writes.
Write = Callable[[np.ndarray, tuple[int, ...], np.ndarray], None]


class ClosedForm:
    """Outputs and per-sample parameter gradients of ``MultidimLinear`` by its closed form.

    The gradient of Σ_k dl_k·y_k with respect to the weight is x ⊗ dl, and dl
    for the bias. The outputs and d loss/d y come from the very operations the
    autograd route runs (the forward vmapped over per-pixel stride-0 copies of
    the parameters, as ``_expanded_gradients`` runs it), and the rule's
    products are the single multiplications autograd's batched products make,
    so the values are the same bits. The rule writes each pixel's gradient
    straight into the stored (pixel-last) layout, where autograd's come
    pixel-first through batched products with an inner size of 1 and are then
    transposed (10×10×4 model, 62,500 pixels, one thread: 0.041 s against 0.133 s).
    On a GPU with TF32 matrix products switched on (PyTorch's default is off),
    autograd's products would be rounded to TF32 and these are not.
    """

    def __init__(self, module: MultidimLinear, config: ModelConfig) -> None:
        self.rule = module.per_sample_parameter_gradients
        self.weight_shape = tuple(module.weight.shape)
        f, loss = _single_sample_fns(module, config)
        self._forward = vmap(f, in_dims=(0, None, 0))
        self._losses = vmap(loss, in_dims=(0, 0 if config.objective == "mse" else None))

    def forward(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        xs: torch.Tensor,
        t: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs y and d loss/d y of the pixels ``xs`` (m, *input), both (m, n_out)."""
        n = xs.shape[0]
        p_in = {k: v.detach().expand(n, *v.shape) for k, v in params.items()}
        with torch.no_grad():
            y = self._forward(p_in, buffers, xs)
        with torch.enable_grad():
            y_d = y.detach().requires_grad_()
            (dl,) = torch.autograd.grad(self._losses(y_d, t).sum(), y_d)
        return y, dl

    @staticmethod
    def finite(x: torch.Tensor, y: torch.Tensor, dl_t: torch.Tensor) -> torch.Tensor:
        """Whether each pixel's outputs are all finite, without reading them back.

        ``x`` (coef, m), ``y`` (m, n_out), ``dl_t`` (n_out, m). A weight gradient
        is x_i·dl_k, and rounding is monotonic, so all are finite exactly when
        the largest, max|x|·max|dl| (one of them), is; NaN propagates through amax.
        """
        big = x.abs().amax(dim=0) * dl_t.abs().amax(dim=0)
        return torch.isfinite(big) & torch.isfinite(dl_t).all(dim=0) & torch.isfinite(y).all(dim=1)

    def __call__(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        xs: torch.Tensor,
        x: torch.Tensor,
        t: torch.Tensor | None,
        outputs: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """One chunk: its outputs into ``outputs`` (pixel-last), and whether each is finite.

        ``xs`` (m, *input) and ``x`` (coef, m) are the same pixels; ``t`` pixel-first.
        """
        y, dl = self.forward(params, buffers, xs, t)
        outputs["prediction"].copy_(y.t())
        dl_t = dl.t()
        grads = {k: outputs[f"grad:{k}"] for k in params}
        grads["weight"] = grads["weight"].reshape(*self.weight_shape[:-1], *dl_t.shape)
        self.rule(x.reshape(*self.weight_shape[:-1], -1), dl_t, grads)
        return self.finite(x, y, dl_t)

    def write_rows(
        self,
        x_row: Callable[[int], torch.Tensor],
        y_t: torch.Tensor,
        dl_t: torch.Tensor,
        dest: Mapping[str, np.ndarray],
        write: Write,
    ) -> None:
        """A whole tile's outputs, written a block of whole rows at a time.

        ``x_row(r)``: the r-th input element of every pixel, (n,); ``y_t`` and
        ``dl_t`` (n_out, n); ``dest`` the stored arrays, pixel-last. Each
        weight row block is made in one small buffer and written at once: the
        gradients never exist whole in memory.
        """
        write(dest["prediction"], (), y_t.numpy())
        write(dest["grad:bias"], (), dl_t.numpy())
        buf = torch.empty(dl_t.shape, dtype=dl_t.dtype)
        lead = self.weight_shape[:-1]
        for r in range(int(np.prod(lead))):
            self.rule(x_row(r), dl_t, {"weight": buf})
            write(
                dest["grad:weight"], tuple(int(i) for i in np.unravel_index(r, lead)), buf.numpy()
            )


def _closed_form(module: nn.Module, config: ModelConfig) -> ClosedForm | None:
    """The model's closed form (:class:`ClosedForm`), if it has one; else None.

    Only gridsolve's own ``MultidimLinear`` has one, and only for gradients
    with respect to the parameters: a user's module, or a subclass that may
    change the forward, takes autograd.
    """
    if type(module) is not MultidimLinear or config.wrt != "params":
        return None
    return ClosedForm(module, config)


def _eager_or_vjp(expanded: Gradients, vjp_grads: Gradients) -> Gradients:
    """``expanded`` in eager mode; ``vjp_grads`` under torch.compile or once ``expanded`` failed.

    ``expanded`` fails where vmap has no batching rule for a batched weight.
    """
    use_expanded = [True]

    def grads(
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        t: torch.Tensor | None,
    ) -> tuple[Any, torch.Tensor]:
        if not torch.compiler.is_compiling() and use_expanded[0]:
            try:
                return expanded(params, buffers, x, t)
            except Exception as exc:  # vmap(vjp) batches what the copies cannot
                use_expanded[0] = False  # a real error recurs there, and is reported from it
                log.debug("per-sample gradients by vmap(vjp): %s", exc)
            torch_func_ready()  # its first call imports torch._dynamo: setup, not compute
        return vjp_grads(params, buffers, x, t)

    return grads
