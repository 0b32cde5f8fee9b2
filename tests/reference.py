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


def histograms_against(logdir: str, held: dict[str, list[torch.Tensor]]) -> dict[str, tuple]:
    """For each layer of ``held`` (the gradient elements a test read itself): ((count, min, max) of
    the last ``gradwatch/hist/<layer>`` histogram under ``logdir``, (the same) of its elements), None
    for a histogram that was not written or a layer with no element."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logdir, size_guidance={"histograms": 0})
    events.Reload()
    result = {}
    for name, pieces in held.items():
        tag = f"gradwatch/hist/{name}"
        h = events.Histograms(tag)[-1].histogram_value if tag in events.Tags()["histograms"] else None
        mine = torch.cat([p.reshape(-1).double() for p in pieces]) if pieces else None
        result[name] = (None if h is None else (h.num, h.min, h.max),
                        None if mine is None else (mine.numel(), float(mine.min()), float(mine.max())))  # fmt: skip
    return result
