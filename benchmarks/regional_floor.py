"""The compiled judged floor in the form regional compilation needs (#30): per-layer state as tensors.

:class:`compiled_floor.CompiledJudgedReadFloor` keys its ops by a constant layer index in the graph and
returns its forward sums as graph outputs: the least a model compiled whole can do, but each layer's
graph is then its own, and a model compiled block by block (``block.compile()`` on equal blocks)
compiles a graph per block until dynamo's recompile limit (benchmarks/RESULTS.md, forty-fifth
session). gradwatch's taps hold tensors of equal metadata instead, so equal blocks share one graph;
each such tensor is a graph input, checked and guarded at every call.

:class:`RegionalJudgedReadFloor` is that floor with gradwatch's form and nothing else: each layer's hook
is an object of its own holding a (1,) cell its output's sum is added into (a view of one tensor of
all layers, read on the host after backward) and a zero-size view keying the layer's sampled-step
ops (found by its place in the storage, as ``gradwatch.capture.host_branch`` finds a tap); the ops'
shared state is read by one global path (as ``cells.TAP_STATES``). Same reads, same judgement
as :class:`compiled_floor.CompiledJudgedReadFloor`. No forward order, no alias, no failure handling.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from gradwatch.capture.host_branch import storage_place
from gradwatch.capture.traced_output import forward_sum

from . import compiled_floor as CF
from . import contenders as C

_NAMESPACE = "gradwatch_bench_regional"
#: floor key -> the floor (weakly); and what every layer's hook reads by one path: the tensor its ops
#: declare written, under the same key
_FLOORS: "weakref.WeakValueDictionary[int, RegionalJudgedReadFloor]" = weakref.WeakValueDictionary()
_WRITTEN: dict[int, torch.Tensor] = {}


def _kernel(read: str):
    """An op's Python kernel: on its floor's sampled steps, the floor's method ``read`` of (the layer
    ``layer_key`` keys, tensor). (The forward op takes the written tensor before ``key``: the key is last.)"""

    def kernel(tensor: torch.Tensor, layer_key: torch.Tensor, *written_and_key: Any) -> None:
        key = written_and_key[-1]
        if not CF.GATE[key]:
            return
        floor = _FLOORS.get(key)
        if floor is not None:
            getattr(floor, read)(floor.layer_at[storage_place(layer_key)], tensor)

    return kernel


#: The forward op declares the shared tensor written (it keeps the calls in the forward's order, and in
#: the graph); the backward op declares nothing written and is kept by its registered side effect, as
#: gradwatch's are (``capture/host_branch.py``): a tensor the backward op took would be saved for the
#: backward, and each block's forward op would bump its version before that backward ran.
_SCHEMAS = {
    "read_output": ("(Tensor output, Tensor layer_key, Tensor(a!) written, int key) -> ()", _kernel("read_sampled_output")),
    "read_out_grad": ("(Tensor grad, Tensor layer_key, int key) -> ()", _kernel("read_sampled_out_grad")),
}
_LIBRARY = CF.define_gated_ops(_NAMESPACE, "keyed", _SCHEMAS)
_read_output = torch.ops.gradwatch_bench_regional.read_output.keyed
_read_out_grad = torch.ops.gradwatch_bench_regional.read_out_grad.keyed


class _LayerHook:
    """One layer's forward hook: its cell and its key are tensors, the rest equal across layers."""

    def __init__(self, cell: torch.Tensor, layer_key: torch.Tensor, key: int) -> None:
        self.cell, self.layer_key, self.key = cell, layer_key, key

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        out = C._first_tensor(output)
        if out is None or not out.is_floating_point():
            return
        written = _WRITTEN[self.key]
        with torch.no_grad():
            self.cell.add_(forward_sum(out))
            _read_output(out, self.layer_key, written, self.key)
        if out.requires_grad:
            out.register_hook(self.on_grad)

    def on_grad(self, grad: torch.Tensor) -> torch.Tensor:
        _read_out_grad(grad, self.layer_key, self.key)
        return grad


class RegionalJudgedReadFloor(CF.CompiledJudgedReadFloor):
    """:class:`compiled_floor.CompiledJudgedReadFloor` whose per-layer state is tensors (module docstring):
    the floor of a compiled model whose equal blocks must share one graph. CPU only (the judgement
    reads host memory)."""

    name = "contract's read floor judged every step, compiled, per-layer tensors"
    #: its gap's label in ``overhead.steady_section`` (the judged floors' share one otherwise)
    gap_label = "gradwatch above the judged floor with per-layer tensors"

    def __init__(self, model: nn.Module, workload: Any, device: torch.device, flush_every: int = 50,
                 cpu_reductions: bool | None = None, backend: str = "inductor") -> None:  # fmt: skip
        super().__init__(model, workload, device, flush_every, cpu_reductions, backend)
        for handle in self.handles:  # the constant-index hooks, replaced
            handle.remove()
        # keyed as the compiled floors are (their key, and their gate: ``CompiledContractReadFloor.step`` sets it)
        _FLOORS[self.key] = self
        _WRITTEN[self.key] = self.written
        weakref.finalize(self, _WRITTEN.pop, self.key, None)
        n = len(self.layers)
        self.sums = torch.zeros(n, device=device)
        self.sums_host = self.sums.numpy()
        keys = torch.zeros(n, dtype=torch.float64, device=device)
        self.layer_at: dict[tuple[int, int], int] = {}
        self.handles = []
        for i, layer in enumerate(self.layers):
            layer_key = keys.data[i:i].data
            self.layer_at[storage_place(layer_key)] = i
            hook = _LayerHook(self.sums.data[i : i + 1].data, layer_key, self.key)
            self.handles.append(layer.module.register_forward_hook(hook))

    def _forward_total(self) -> float:
        """The step's forward sums, added on the host, and their cells zeroed (host memory)."""
        total = sum(self.sums_host.tolist())
        self.sums_host.fill(0.0)
        return total

    def close(self) -> None:
        _FLOORS.pop(self.key, None)
        super().close()
