"""The output-gradient tap as an autograd node, for compiled frames that hold a KV cache.

In torch 2.13 a ``Tensor.register_hook`` on an intermediate is traced with side effects
restored afterwards; an attribute set later on an object created earlier in the frame is lost
(transformers' ``DynamicLayer.lazy_initialization`` sets ``self.device``). dynamo then drops the
whole-model graph and ``fullgraph=True`` fails (docs/reference.md, "Compiled models"). An
autograd function is traced without that speculation, so while the model's cache is on,
compiled taps hand each output through :class:`OutputGradTap` instead of registering a hook.

Its forward returns a *copy* of the output, not a view: an identity that returned the input
(a view) would make an in-place op after the layer (``ReLU(inplace=True)``, a residual ``+=``)
fail ("a view ... is being modified inplace"). The copy has the output's values, so the model
computes exactly what it did; inductor removes the copy when nothing needs it apart
(``clone`` is a no-op after functionalization).
"""

from __future__ import annotations

from typing import Any

import torch


class OutputGradTap(torch.autograd.Function):
    """Identity (a copy) whose backward gives the output's gradient to ``tap.on_output_grad``."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, tap: Any) -> torch.Tensor:
        ctx.tap = tap
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.tap.on_output_grad(grad)
        return grad, None


def can_pass_through(output: Any, first: torch.Tensor) -> bool:
    """Whether a forward hook can put a copy of ``first`` (the output's first floating-point
    tensor) back in its place: the output is that tensor, or a plain tuple that starts with it."""
    return output is first or (type(output) is tuple and len(output) > 0 and output[0] is first)


def pass_through(output: Any, first: torch.Tensor, taps: tuple[Any, ...]) -> Any:
    """``output`` with ``first`` handed through an :class:`OutputGradTap` for each tap (see
    :func:`can_pass_through`, which must hold)."""
    tapped = first
    for tap in taps:
        tapped = OutputGradTap.apply(tapped, tap)
    return tapped if output is first else (tapped, *output[1:])
