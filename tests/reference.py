"""Independent reference computations for statistic values (never the code under test)."""

from __future__ import annotations

import math

import torch
from torch import nn


def own_grad_norm(module: nn.Module) -> float:
    """L2 norm of the gradients of the module's own parameters, via torch.linalg.vector_norm."""
    grads = [p.grad.reshape(-1).double() for p in module.parameters(recurse=False) if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat(grads)))


class RetainedOutputs:
    """Retains the gradient of every call's output of the named modules (first tensor of tuples)."""

    def __init__(self, model: nn.Module, names: list[str], pick=None) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.handles = []
        for name in names:
            module = model.get_submodule(name)
            self.handles.append(module.register_forward_hook(lambda m, a, out, n=name: self._keep(n, out, pick)))

    def _keep(self, name, out, pick):
        t = pick(out) if pick else (out if isinstance(out, torch.Tensor) else out[0])
        if torch.is_grad_enabled() and t.requires_grad:
            t.retain_grad()
            self.outputs[name].append(t)

    def norm(self, name: str) -> float:
        return math.sqrt(sum(float(t.grad.double().pow(2).sum()) for t in self.outputs[name] if t.grad is not None))

    def clear(self) -> None:
        for v in self.outputs.values():
            v.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
