"""The contract's read floor inside compiled code (#30): :class:`contenders.ContractReadFloor`'s reads
and writes, with the reads of sampled steps behind gated opaque ops, as gradwatch's compiled taps
take them (``gradwatch/capture/host_branch.py``).

A compiled model cannot branch on the host's "is this step sampled" without a graph per kind of step,
so any implementation of the contract's sampled statistics in compiled code needs what gradwatch
does: an op in the graph that the generated code calls only on sampled steps. Here each layer's
forward hook (traced) sums its output (the per-step check, fused into the model's kernels as in
the compiled per-step floor), calls one such op with its output and registers a tensor hook that
calls the other with its output gradient. The ops run eagerly on sampled steps and make the eager
floor's reads (the cheapest known on the CPU, in the tensor's dtype); inductor's wrapper calls their
kernels directly behind a dict read (gradwatch's ``_compat.inductor``: no dispatcher, no Python
frame on an unsampled step). The parameter gradients' norms, max |g| and the flush are the eager
floor's: they run outside the compiled code.

What it leaves out, so that it stays a floor: the taps' cells (the ops keep their reads in Python
lists, as the eager floor does), the forward order, exact reductions, every check and the
bookkeeping of ``step()``. Its layer index is a constant in the graph (a model compiled whole, as the
benchmarks compile it; a regionally compiled model would recompile per block), and its ops declare
one shared tensor as written (one graph input for every layer) so that they stay in the graph.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from typing import Any

import torch
from torch import nn

from gradwatch._compat import inductor as inductor_compat

from . import contenders as C

_NAMESPACE = "gradwatch_bench"
#: key -> the floor whose ops these are (weakly: a closed floor's ops read nothing)
_FLOORS: "weakref.WeakValueDictionary[int, CompiledContractReadFloor]" = weakref.WeakValueDictionary()
#: key -> whether its floor's step is sampled: what inductor's wrapper reads before it calls the ops
GATE: "collections.defaultdict[int, bool]" = collections.defaultdict(bool)


def _kernel(read: str):
    """An op's Python kernel: on its floor's sampled steps, the floor's method ``read`` of (layer, tensor)."""

    def kernel(tensor: torch.Tensor, written: torch.Tensor, key: int, layer: int) -> None:
        if not GATE[key]:
            return
        floor = _FLOORS.get(key)
        if floor is not None:
            getattr(floor, read)(layer, tensor)

    return kernel


_SCHEMAS = {
    "read_output": ("(Tensor output, Tensor(a!) written, int key, int layer) -> ()", _kernel("read_sampled_output")),
    "read_out_grad": ("(Tensor grad, Tensor(a!) written, int key, int layer) -> ()", _kernel("read_sampled_out_grad")),
}


def define_gated_ops(namespace: str, overload: str, schemas: dict[str, tuple[str, Any]]) -> "torch.library.Library":
    """The floors' opaque ops: ``torch.ops.<namespace>.<name>.<overload>`` for each ``name: (schema,
    kernel)`` of ``schemas``, as gradwatch defines its own (``capture/host_branch.py``): one Python
    kernel for every backend, called directly by inductor's wrapper behind :data:`GATE` (keyed by the
    op's ``key`` argument), and an op that declares nothing written kept in the graph by its
    registered side effect."""
    names = tuple(f"torch.ops.{namespace}.{name}.{overload}" for name in schemas)

    def returns_nothing(*args: Any) -> None:
        # The fake kernel runs while AOTAutograd traces, before inductor generates code: the moment
        # to have inductor call the kernels directly (as gradwatch's own ops do).
        inductor_compat.call_directly(names)

    tags = tuple(getattr(torch.Tag, name) for name in ("flexible_layout", "cudagraph_unsafe") if hasattr(torch.Tag, name))
    library = torch.library.Library(namespace, "DEF")
    for name, (schema, kernel) in schemas.items():
        library.define(f"{name}.{overload}{schema}", tags=tags)
        library.impl(f"{name}.{overload}", kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{namespace}::{name}.{overload}", returns_nothing, lib=library)
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        inductor_compat.attach_kernel(op, kernel, GATE, "key")
        if "(a!)" not in schema:
            torch.fx.node.has_side_effect(op)
    return library


_LIBRARY = define_gated_ops(_NAMESPACE, "gated", _SCHEMAS)
read_output = torch.ops.gradwatch_bench.read_output.gated
read_out_grad = torch.ops.gradwatch_bench.read_out_grad.gated


class CompiledContractReadFloor(C.ContractReadFloor):
    """:class:`contenders.ContractReadFloor` with the model compiled (inductor), its sampled reads behind
    gated opaque ops (module docstring). Device-agnostic, like the eager floor."""

    name = "contract's read floor, compiled"
    compiled = True

    def __init__(self, model: nn.Module, workload: Any, device: torch.device, flush_every: int = 50,
                 cpu_reductions: bool | None = None, backend: str = "inductor") -> None:  # fmt: skip
        self.key = next(k for k in itertools.count(1) if k not in _FLOORS)
        _FLOORS[self.key] = self
        #: what the ops declare they write (nothing is written): one tensor every layer's call names
        self.written = torch.zeros(1, device=device)
        self.backend = backend
        super().__init__(model, workload, device, flush_every, cpu_reductions)

    def _read(self, module: nn.Module, out: torch.Tensor) -> None:
        """Traced, at every step (grad mode off): the per-step floor's sum, then the sampled reads'
        op, and a tensor hook that calls the other op with the output gradient."""
        C.DefaultStepFloor._read(self, module, out)
        layer = self.index[id(module)]
        read_output(out, self.written, self.key, layer)
        if out.requires_grad:
            out.register_hook(lambda g: self._out_grad_hook(g, layer))

    def _out_grad_hook(self, grad: torch.Tensor, layer: int) -> torch.Tensor:
        read_out_grad(grad, self.written, self.key, layer)
        return grad

    def read_sampled_output(self, layer: int, out: torch.Tensor) -> None:
        """The eager floor's sampled reads of one output (run by the op, on sampled steps)."""
        self._sampled_output(out, self._written_for(layer))

    def read_sampled_out_grad(self, layer: int, grad: torch.Tensor) -> None:
        """The eager floor's sampled reads of one output gradient (run by the op, on sampled steps)."""
        if grad.ndim:
            layers = self._written_for(layer)
            self._grad_hook(grad, layers, self._unit_dim(layers, grad))

    def step(self) -> None:
        if self._run is None:
            self._run = C.compile_alone(self.model, backend=self.backend)
        GATE[self.key] = bool(self.sampled[self.slot])
        super().step()

    def close(self) -> None:
        GATE[self.key] = False
        _FLOORS.pop(self.key, None)
        super().close()


class CompiledJudgedReadFloor(CompiledContractReadFloor, C.JudgedReadFloor):
    """:class:`CompiledContractReadFloor` with the least per-step judgement the default must make
    (:class:`contenders.JudgedReadFloor`'s, on the host after backward: the compiled code's forward sums
    are its outputs, appended by dynamo as the eager hooks append them). What exactness needs of a
    compiled model's unsampled step, as the eager judged floor is of an eager one. CPU only."""

    name = "contract's read floor judged every step, compiled"
