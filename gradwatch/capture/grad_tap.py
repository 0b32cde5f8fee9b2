"""The tensor hook a layer's tap puts on its output: the output gradient's statistics into the
layer's backward cells (``taps.py`` says what may run there: traceable tensor ops into cells).

Eager, on sampled steps only: the sum of squares is written into its cell at the layer's first
gradient of the step (``out=``) and added after it, the dead-unit evidence is added in the cells'
float64, and the calls and samples are host counts (``host_cells.py``). Inside compiled code the
counts are device cells, and the statistics are computed in a branch of ``torch.cond`` on the
host's sampling flag (or at every step with ``detail="full"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .. import _compat
from ..distributed.sharding import local_tensor
from . import host_branch
from .grad_statistics import GradStatistics
from .host_cells import HostCells

if TYPE_CHECKING:
    from .cells import DeviceTapState

_set_grad_enabled = torch._C._set_grad_enabled  # traceable, and cheaper than detach() per call


#: Operands of this many dimensions or more (images, volumes: convolution outputs and their gradients)
#: never go to a ``torch.cond`` branch: inductor may lay them out channels-last (layout optimisation)
#: after the branch was compiled for their traced strides, or contiguous where they were traced
#: channels-last, and the branch then fails its stride assert at the first sampled step (torch 2.13:
#: the forward's output statistics on a small conv net, the backward's gradient statistics on a
#: ResNet-18; ``tests/compile/test_compile.py`` holds it). They go to an opaque op that branches on
#: the host's flag at run time instead (``host_branch.py``).
RELAID_NDIM = 4


def on_sampled_steps(shared: "DeviceTapState", compute: Callable[[torch.Tensor], tuple],
                     zeros: Callable[[torch.Tensor], tuple], operand: torch.Tensor, branch: bool,
                     opaque: Callable[[torch.Tensor], tuple]) -> tuple:  # fmt: skip
    """Inside compiled code: ``compute(operand)`` on sampled steps, ``zeros(operand)`` (the same
    shapes) on the others, as a tuple of tensors. ``shared``: the device's ``cells.DeviceTapState``.
    ``branch``: ``torch.cond`` can be traced in the caller's frame (not in compiled autograd's graph,
    nor in a frame with Hugging Face's KV cache): then a branch the graph takes at run time on the
    host's flag (``shared.plan.on_host``, a CPU tensor: reading it never waits for the device), so
    unsampled steps pay nothing. For operands of ``RELAID_NDIM`` or more dimensions, and where the
    branch cannot be traced, ``opaque(operand)``: the same computation as an op of
    ``host_branch.py``, which reads the flag when it runs. Otherwise (a torch before 2.13, untested
    with either; a process where the ops could not be defined) computed at every step and kept where
    the device's flag ``shared.sampled`` says so (a non-finite value of an unsampled step cannot
    leak: ``where`` selects, it does not multiply)."""
    if _compat.COND_IN_HOOKS:
        if branch and operand.ndim < RELAID_NDIM:
            return tuple(torch.cond(shared.plan.on_host, compute, zeros, (operand,)))
        if host_branch.DEFINED:
            return tuple(opaque(operand))
    return tuple(torch.where(shared.sampled, value, 0.0) for value in compute(operand))


class GradTap:
    """What one layer records of its output gradients.

    Its hook (:meth:`on_output_grad`) is handed the device's shared state (``cells.DeviceTapState``:
    the recording flags, the sampling flag, the projection weights) by the layer's ``OutputTap``
    rather than holding it: compiled code then reaches that state by one path (``cells.py``).

    Args:
        grad_stats: what one output gradient contributes.
        host: the host counts; ``index``: this layer's place in them.
        grad_cells: the layer's (3,) backward cells: sum of squares, calls, samples (what compiled
            code reads, sliced at offsets equal across layers); ``units``: its dead-unit evidence cell.
        failed: called with an exception raised inside the hook (reported at step()).
    """

    def __init__(self, grad_stats: GradStatistics, *, host: HostCells, index: int, grad_cells: torch.Tensor,
                 units: torch.Tensor, failed: Callable[[BaseException], None]) -> None:  # fmt: skip
        self.grad_stats = grad_stats
        self.host, self.index = host, index
        self.grad_cells, self.units = grad_cells, units
        # The same cells as the one-op writes' shapes (eager): the sum of squares 0-d, the units a row.
        self.step_sq = grad_cells.data[0:1].view(())
        self.unit_row = units.data.view(1, units.numel())
        self.failed = failed
        self.grad_at = -1  # plan.step of this layer's latest output gradient (eager)


    def on_output_grad(self, grad: torch.Tensor, shared: "DeviceTapState") -> torch.Tensor:
        """Tensor hook on the output: sum of squares (float64), calls and dead-unit evidence.
        ``shared``: the device's ``cells.DeviceTapState``."""
        grad_mode = torch.is_grad_enabled()  # on only in a backward with create_graph=True
        _set_grad_enabled(False)
        try:
            self._record(local_tensor(grad), shared)
        except Exception as exc:  # never break training: reported at step() (nothing raises when traced)
            self.failed(exc)
        finally:
            _set_grad_enabled(grad_mode)
        return grad

    def _record(self, g: torch.Tensor, shared: "DeviceTapState") -> None:
        """Fold one output gradient into the step's cells (eager hooks run on sampled steps only):
        its statistics written into the cells at the step's first gradient, added after it; the
        calls and samples counted on the host."""
        if torch.compiler.is_compiling():
            if shared.plan.every_step:
                self._record_every_step(g, shared.weights)
            else:
                self._record_traced(g, shared)
            return
        step = shared.plan.step
        first = self.grad_at != step
        self.grad_at = step
        samples = self.grad_stats.record(g, self.step_sq, self.unit_row, first)
        host, i = self.host, self.index
        host.add(host.calls, i, 1.0)
        host.add(host.samples, i, samples)

    def _record_every_step(self, g: torch.Tensor, weights: torch.Tensor) -> None:
        """``_record`` inside compiled code with ``detail="full"``: every step is sampled, the
        counts are device cells (compiled code runs no host code per call)."""
        sq, evidence, samples = self.grad_stats.of(g, weights)
        cells = self.grad_cells  # [sum of squares, calls, samples]
        cells[1:2].add_(1.0)
        cells[0:1].add_(sq)
        if evidence is not None:
            self.units.addcmul_(evidence, evidence)
            cells[2:3].add_(samples)

    def _record_traced(self, g: torch.Tensor, shared: "DeviceTapState") -> None:
        """``_record`` inside compiled code: the statistics are computed on sampled steps only,
        by a branch the graph takes at run time on the host's flag (``torch.cond``; a CPU tensor, so
        reading it never waits for the device), and added to the cells as deltas (a branch of
        ``torch.cond`` may not write its inputs)."""
        count, stats, cells, weights = shared.sampled_count, self.grad_stats, self.grad_cells, shared.weights
        cells[1:2].add_(count)
        # Compiled autograd traces this hook into its own graph, where torch.cond fails: there the
        # statistics go to the opaque op.
        branch = not _compat.in_compiled_autograd()
        key = shared.plan.key

        def opaque(t: torch.Tensor) -> tuple:
            return host_branch.output_grad_deltas(t, weights, key, stats.units, stats.channel_first, stats.unit_sums,
                                                  stats.dtype)  # fmt: skip

        sq, evidence = on_sampled_steps(shared, lambda t: stats.deltas(t, weights), stats.no_deltas, g, branch, opaque)
        cells[0:1].add_(sq)
        if stats.judged(g):
            self.units.add_(evidence)
            cells[2:3].add_(count * stats.samples(g))
