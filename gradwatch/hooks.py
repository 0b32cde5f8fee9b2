"""Module hooks that see each layer's output and its gradient.

Design: a forward hook registers a *tensor* hook on the layer's output instead
of using ``register_full_backward_hook``. Full backward hooks wrap the output
in ``BackwardHookFunction``; an in-place op after the module (``ReLU(inplace=True)``,
``out += identity``) then fails with "Output 0 of BackwardHookFunctionBackward
is a view and is being modified inplace" (pytorch#61519), and outputs that are
dicts are silently skipped. A tensor hook registered before an in-place op
receives the gradient of the pre-in-place value, works for any output
structure, and costs one Python call per module call.

The hooks do as little Python as possible: the forward hook folds a
non-finite flag of the output into a 0-d accumulator and registers the
tensor hook; the tensor hook computes the per-unit L2 norm of the output
gradient (one pass over the gradient) and appends it to a list that
``Recorder.fold`` reduces with a handful of fused ops at step time.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Callable

import torch
from torch.utils.hooks import RemovableHandle

from .layers import LayerSpec, grad_tensors

if TYPE_CHECKING:
    from .recorder import Recorder

log = logging.getLogger("gradwatch")


class HookSet:
    """The forward hooks gradwatch registered; ``remove()`` takes every one of them off."""

    def __init__(self, layers: list[LayerSpec], recorder: "Recorder") -> None:
        self._handles: list[RemovableHandle] = []
        also = output_aliases(layers)
        for index, layer in enumerate(layers):
            hook = _make_forward_hook(index, layer, recorder, also.get(index, ()))
            self._handles.append(layer.module.register_forward_hook(hook))

    def remove(self) -> None:
        """Remove every hook; idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _is_compiling() -> bool:
    # Looked up at each call on purpose: with a module-level alias of
    # torch.compiler.is_compiling, torch 2.13's compile ran the hook eagerly instead
    # (test_torch_compile_runs_with_right_parameter_statistics caught it).
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and getattr(compiler, "is_compiling", lambda: False)())


def _warn_compile_once(recorder: "Recorder") -> None:
    if not recorder.warned_compile:
        recorder.warned_compile = True
        log.warning(
            "gradwatch: inside torch.compile'd code the output-gradient statistics "
            "(out_grad_norm, dead_fraction) and the forward non-finite check are not recorded; "
            "parameter-gradient statistics are. Attach gradwatch and run eagerly for the full set."
        )


def output_aliases(layers: list[LayerSpec]) -> dict[int, tuple[int, ...]]:
    """Layers whose output is also another monitored layer's output, by index.

    ``nn.MultiheadAttention`` applies its ``out_proj`` functionally (``F.linear`` with
    ``out_proj.weight``), so ``out_proj``'s own forward hook never runs; the attention's
    output is exactly ``out_proj``'s output, so it is recorded for both layers.
    """
    index = {id(layer.module): i for i, layer in enumerate(layers)}
    aliases: dict[int, tuple[int, ...]] = {}
    for i, layer in enumerate(layers):
        if isinstance(layer.module, torch.nn.MultiheadAttention):
            target = index.get(id(layer.module.out_proj))
            if target is not None:
                aliases[i] = (target,)
    return aliases


def _make_forward_hook(index: int, layer: LayerSpec, recorder: "Recorder", also: tuple[int, ...] = ()) -> Callable:
    grad_enabled = torch.is_grad_enabled
    tensor_type = torch.Tensor
    on_forward = recorder.on_forward
    # copy.deepcopy(model) copies the hook dicts too: the copy must not record into this monitor.
    owner = weakref.ref(layer.module)

    def forward_hook(module: torch.nn.Module, args: object, output: object) -> None:
        if not grad_enabled() or not recorder.active or module is not owner():
            return
        try:
            if _is_compiling():
                _warn_compile_once(recorder)
                return
            if type(output) is tensor_type:
                if output.is_floating_point():
                    on_forward(index, output)
                return
            tensors = grad_tensors(output)
            if tensors:
                on_forward(index, tensors[0])
                for alias in also:  # the same output belongs to another layer too (MHA's out_proj)
                    on_forward(alias, tensors[0])
                for extra in tensors[1:]:  # e.g. an RNN's h_n: same units, also an output
                    on_forward(index, extra, extra=True)
        except Exception as exc:  # a monitor must never break training
            recorder.hook_failed(layer.name, exc)

    return forward_hook
