"""The tensor hook a layer's tap puts on its output: the output gradient's statistics into the
layer's backward cells (``taps.py`` says what may run there: traceable tensor ops into cells).

Eager, on sampled steps only: the sum of squares is written into its cell at the layer's first
gradient of the step (``out=``) and added after it, the dead-unit evidence is added in the cells'
float64, and the calls and samples are host counts (``host_cells.py``). Inside compiled code the
counts are device cells, written on sampled steps by an opaque op that reads the host's sampling
flag when it runs (``host_branch.py``; or, with ``detail="full"``, by the graph at every step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..distributed.sharding import local_tensor
from . import host_branch
from .grad_statistics import ROW_COUNTS, GradStatistics
from .host_cells import HostCells

if TYPE_CHECKING:
    from .cells import DeviceTapState

_set_grad_enabled = torch._C._set_grad_enabled  # traceable, and cheaper than detach() per call


def masked(shared: "DeviceTapState", values: tuple) -> tuple:
    """``values`` on sampled steps, zeros on the others, by the device's flag ``shared.sampled``
    (``shared``: the device's ``cells.DeviceTapState``): compiled taps' path where the opaque ops of
    ``host_branch.py`` are not in use (:data:`host_branch.IN_USE`), which computes at every step
    what only sampled steps keep. A non-finite value of an unsampled step cannot leak: ``where``
    selects, it does not multiply."""
    return tuple(torch.where(shared.sampled, value, 0.0) for value in values)


def row_key_of(grad_row: torch.Tensor) -> torch.Tensor:
    """A zero-size view of ``grad_row`` at its start: the key by which the opaque ops of
    ``host_branch.py`` find a layer's tap (``RecordingFlags.taps_at``: by storage and offset). Compiled
    code hands the ops tensors (a per-layer constant would make each block of a regionally compiled
    model a graph of its own), and every tensor a graph takes with elements is checked at every call
    by inductor's ``assert_size_stride`` (~4.1 K instructions with torch 2.13's stringstream), while
    one with no elements is not: handed the rows themselves, the compiled MLP's forward and backward
    executed ~106 K instructions more a step (benchmarks/RESULTS.md, forty-fourth session). Detached
    (``.data``): no base for dynamo to follow, a version counter of its own."""
    return grad_row.data[0:0].data


class GradTap:
    """What one layer records of its output gradients.

    Its hook (:meth:`on_output_grad`) is handed the device's shared state (``cells.DeviceTapState``:
    the recording flags, the sampling flag, the projection weights) by the layer's ``OutputTap``
    rather than holding it: compiled code then reaches that state by one path (``cells.py``).

    Args:
        grad_stats: what one output gradient contributes.
        host: the host counts; ``index``: this layer's place in them.
        grad_row: the layer's backward cells, one tensor (what compiled code reads, sliced at offsets
            equal across layers): sum of squares, calls, samples, then its dead-unit evidence.
            Its zero-size view at its start, :attr:`row_key`, is what the opaque ops of
            ``host_branch.py`` are handed to find this layer's tap (:func:`row_key_of`).
        failed: called with an exception raised inside the hook (reported at step()).
    """

    def __init__(self, grad_stats: GradStatistics, *, host: HostCells, index: int, grad_row: torch.Tensor,
                 failed: Callable[[BaseException], None]) -> None:  # fmt: skip
        self.grad_stats = grad_stats
        self.host, self.index = host, index
        self.grad_row = grad_row
        self.row_key = row_key_of(grad_row)
        # The same cells as the one-op writes' shapes (eager): the sum of squares 0-d, the units a row.
        self.step_sq = grad_row.data[0:1].view(())
        self.unit_row = grad_row.data[ROW_COUNTS:].view(1, grad_row.numel() - ROW_COUNTS)
        self.failed = failed
        self.grad_at = -1  # flags.step of this layer's latest output gradient (eager)

    def on_output_grad(self, grad: torch.Tensor, shared: "DeviceTapState") -> torch.Tensor:
        """Tensor hook on the output: sum of squares (float64), calls and dead-unit evidence.
        ``shared``: the device's ``cells.DeviceTapState``. Returns ``grad`` unchanged. Also what the
        opaque op of ``host_branch.py`` calls at a compiled sampled call (at run time: the eager path)."""
        grad_mode = torch.is_grad_enabled()  # on only in a backward with create_graph=True
        _set_grad_enabled(False)
        try:
            if torch.compiler.is_compiling():
                # by the class, not the instance: one guard for every layer (taps.OutputTap._record_outputs)
                GradTap._record_traced(self, grad if type(grad) is torch.Tensor else local_tensor(grad), shared)
            else:
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
        step = shared.flags.step
        first = self.grad_at != step
        self.grad_at = step
        samples = self.grad_stats.record(g, self.step_sq, self.unit_row, first)
        host, i = self.host, self.index
        host.add(host.calls, i, 1.0)
        host.add(host.samples, i, samples)

    def _record_traced(self, g: torch.Tensor, shared: "DeviceTapState") -> None:
        """``_record`` inside compiled code, in as few Python frames as it can (dynamo traces this body
        again for every hook it registers: ``taps.py``, "What dynamo needs"). With ``detail="full"``
        every step is sampled and the counts are device cells, written by the graph; otherwise on
        sampled steps only, by the opaque op that reads the host's flag when it runs
        (``host_branch.py``: nothing on the others, no statistics compiled into the graph), or where
        it is not in use, computed at every step and masked."""
        stats, row, weights = self.grad_stats, self.grad_row, shared.weights
        if shared.flags.every_step:
            stats.add_to_cells(g, weights, row)
        elif host_branch.IN_USE:  # (its tap found by the row's zero-size view: no row in the graph)
            host_branch.add_output_grad(g, self.row_key, shared.flags.key)
        else:
            count = shared.sampled_count
            row[1:2].add_(count)
            sq, evidence = masked(shared, stats.deltas(g, weights))
            row[0:1].add_(sq)
            if stats.judged(g):
                row[ROW_COUNTS:].add_(evidence)
                row[2:3].add_(count * stats.samples(g))
