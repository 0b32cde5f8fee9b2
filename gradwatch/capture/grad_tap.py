"""The tensor hook a layer's tap puts on its output: the output gradient's statistics into the
layer's backward cells (``taps.py`` says what may run there: traceable tensor ops into cells).

Eager, on sampled steps only: the sum of squares is written into its cell at the layer's first
gradient of the step (``out=``) and added after it, the dead-unit evidence is added in the cells'
float64, and the calls and samples are host counts (``host_cells.py``). Inside compiled code the
counts are device cells, and the statistics are computed in a branch of ``torch.cond`` on the
host's sampling flag (or at every step with ``detail="full"``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import _compat
from ..distributed.sharding import local_tensor
from .grad_statistics import GradStatistics
from .host_cells import HostCells

_set_grad_enabled = torch._C._set_grad_enabled  # traceable, and cheaper than detach() per call


def on_sampled_steps(plan: Any, sampled: torch.Tensor, compute: Callable[[torch.Tensor], tuple],
                     zeros: Callable[[torch.Tensor], tuple], operand: torch.Tensor, branch: bool) -> tuple:
    """Inside compiled code: ``compute(operand)`` on sampled steps, ``zeros(operand)`` (the same
    shapes) on the others, as a tuple of tensors. ``branch``: in a branch the graph takes at run time
    on the host's flag (``torch.cond`` on ``plan.on_host``, a CPU tensor: reading it never waits for
    the device), so unsampled steps pay nothing; otherwise (where ``torch.cond`` cannot be traced)
    computed at every step and kept where the device's flag ``sampled`` says so (a non-finite value
    of an unsampled step cannot leak: ``where`` selects, it does not multiply)."""
    if branch:
        return tuple(torch.cond(plan.on_host, compute, zeros, (operand,)))
    return tuple(torch.where(sampled, value, 0.0) for value in compute(operand))


class GradTap:
    """What one layer records of its output gradients.

    Args:
        plan: the ``taps.RecordingFlags`` every tap shares (the step count, the host's sampling flag).
        grad_stats: what one output gradient contributes.
        host: the host counts; ``index``: this layer's place in them.
        out_sq, calls, samples: the layer's (1,) backward cells; ``units``: its dead-unit evidence cell.
        sampled, sampled_count: the device's sampling flag, as bool and as 0/1 (compiled code).
        failed: called with an exception raised inside the hook (reported at step()).
    """

    def __init__(self, plan: Any, grad_stats: GradStatistics, *, host: HostCells, index: int, out_sq: torch.Tensor,
                 calls: torch.Tensor, samples: torch.Tensor, units: torch.Tensor, sampled: torch.Tensor,
                 sampled_count: torch.Tensor, failed: Callable[[BaseException], None]) -> None:  # fmt: skip
        self.plan, self.grad_stats = plan, grad_stats
        self.host, self.index = host, index
        self.out_sq, self.calls, self.samples, self.units = out_sq, calls, samples, units
        # The same cells as the one-op writes' shapes (eager): the sum of squares 0-d, the units a row.
        self.step_sq = out_sq.data.view(())
        self.unit_row = units.data.view(1, units.numel())
        self.sampled, self.sampled_count = sampled, sampled_count
        self.failed = failed
        self.grad_at = -1  # plan.step of this layer's latest output gradient (eager)


    def on_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Tensor hook on the output: sum of squares (float64), calls and dead-unit evidence."""
        grad_mode = torch.is_grad_enabled()  # on only in a backward with create_graph=True
        _set_grad_enabled(False)
        try:
            self._record(local_tensor(grad))
        except Exception as exc:  # never break training: reported at step() (nothing raises when traced)
            self.failed(exc)
        finally:
            _set_grad_enabled(grad_mode)
        return grad

    def _record(self, g: torch.Tensor) -> None:
        """Fold one output gradient into the step's cells (eager hooks run on sampled steps only):
        its statistics written into the cells at the step's first gradient, added after it; the
        calls and samples counted on the host."""
        if torch.compiler.is_compiling():
            if self.plan.every_step:
                self._record_every_step(g)
            else:
                self._record_traced(g)
            return
        step = self.plan.step
        first = self.grad_at != step
        self.grad_at = step
        samples = self.grad_stats.record(g, self.step_sq, self.unit_row, first)
        host, i = self.host, self.index
        host.add(host.calls, i, 1.0)
        host.add(host.samples, i, samples)

    def _record_every_step(self, g: torch.Tensor) -> None:
        """``_record`` inside compiled code with ``detail="full"``: every step is sampled, the
        counts are device cells (compiled code runs no host code per call)."""
        sq, evidence, samples = self.grad_stats.of(g)
        self.calls.add_(1.0)
        self.out_sq.add_(sq)
        if evidence is not None:
            self.units.addcmul_(evidence, evidence)
            self.samples.add_(samples)

    def _record_traced(self, g: torch.Tensor) -> None:
        """``_record`` inside compiled code: the statistics are computed on sampled steps only,
        by a branch the graph takes at run time on the host's flag (``torch.cond``; a CPU tensor, so
        reading it never waits for the device), and added to the cells as deltas (a branch of
        ``torch.cond`` may not write its inputs)."""
        count, stats = self.sampled_count, self.grad_stats
        self.calls.add_(count)
        # Compiled autograd traces this hook into its own graph, where torch.cond fails (and a
        # torch before 2.13 is untested with it): there the statistics are masked.
        branch = _compat.COND_IN_HOOKS and not _compat.in_compiled_autograd()
        sq, evidence = on_sampled_steps(self.plan, self.sampled, stats.deltas, stats.no_deltas, g, branch)
        self.out_sq.add_(sq)
        if stats.judged(g):
            self.units.add_(evidence)
            self.samples.add_(count * stats.samples(g))
