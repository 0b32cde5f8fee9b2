"""Whether a backward ran since the last recorded step, from a few parameters' gradients, on the host.

A ``step()`` with no backward since the last one (called twice per iteration, or in an evaluation
loop) would record the same gradients again as a new step. Reading every gradient's version
counter costs about 0.1 ms per 1000 tensors at every step, so a few *witness* parameters are
read instead: the first parameter of the first, last and two middle layers, the layers any
backward reaches in nearly every model (embeddings, heads). A backward changes a witness's
gradient in place (its version counter grows: accumulation, ``zero_grad(set_to_none=False)``)
or replaces it (a new tensor after ``zero_grad()``); a weak reference tells a new tensor from
an old one whose memory Python reused. The step is a repeat only when every witness has a
gradient that is the very tensor of the last recorded step with the same version. A witness
without a gradient says nothing, and a sharded (DTensor) parameter is never one: FSDP2 may
accumulate into its gradient's shard without the wrapper's version changing (a model of DTensors
alone has no witness and is recorded as before). A
parameter whose gradient is split into pieces (FSDP1, DeepSpeed ZeRO) is never a witness: a rank
may hold none of it, and every rank must decide alike.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..distributed.sharding import is_dtensor

#: How many layers lend a witness parameter.
_WITNESSES = 4


class BackwardWitness:
    """Tells a ``step()`` that follows a backward from one that repeats the last step's gradients.

    Args:
        layers: the monitored layers (``LayerSpec``), in model order.
    """

    def __init__(self, layers: list[Any]) -> None:
        # not a gradient split into pieces (LayerSpec.pieces): see the module docstring
        # nor a DTensor (see the module docstring): left out here, so that step() tests no type
        trainable = [layer.params[0] for layer in layers
                     if layer.params and not layer.pieces[0] and not is_dtensor(layer.params[0])]  # fmt: skip
        picks = sorted({round(i * (len(trainable) - 1) / (_WITNESSES - 1)) for i in range(_WITNESSES)}) if trainable else []
        self._params: list[torch.nn.Parameter] = [trainable[i] for i in picks]
        self._marks: list[tuple[Any, int] | None] = [None] * len(self._params)  # (weakref to grad, version)

    def repeats_last_step(self) -> bool:
        """True when no backward ran since :meth:`remember` (every witness's gradient unchanged)."""
        seen = False
        for param, mark in zip(self._params, self._marks):
            grad = param.grad
            if grad is None:
                continue
            if mark is None or mark[0]() is not grad or mark[1] != grad._version:
                return False
            seen = True
        return seen

    def remember(self) -> None:
        """After a step was recorded: its witnesses' gradients, to compare with at the next ``step()``."""
        # (each ``p.grad`` read once: a getter call, after backward)
        self._marks = [None if (g := p.grad) is None else (weakref.ref(g), g._version) for p in self._params]

    def drop_references(self) -> None:
        """``close()``: forget the model's parameters."""
        self._params, self._marks = [], []
