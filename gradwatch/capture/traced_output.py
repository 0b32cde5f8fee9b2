"""What a layer's tap records of one output inside compiled code: the traced half of
``OutputTap.record_output`` (``taps.py`` says what may run here and why).

Every step's graph is the sampled one. The forward check's sum fuses into the kernel that makes the
output or reads it next; what only sampled steps record goes to the opaque op that reads the host's
flag when it runs (``host_branch.py``), or, where that op is not in use, is computed at every step
and masked; with ``detail="full"`` (a constant for the compiled code) every step records it in the
graph. Functions of a module, not methods: compiled code reaches them by one global for every tap
(a method read from a tap would be a guard per tap: ``OutputTap._record_outputs``). They are handed
the device's shared state as the tap's ``__call__`` read it (``cells.TAP_STATES``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import registry
from ..distributed.sharding import local_tensor
from . import host_branch
from .cells import DeviceTapState, add_recorded_output
from .grad_tap import masked

if TYPE_CHECKING:
    from .taps import OutputTap


def record_output(tap: "OutputTap", out: torch.Tensor, checked: bool, shared: DeviceTapState) -> None:
    """``OutputTap.record_output`` while dynamo traces: the forward check unless ``checked``
    (an alias's output, checked by another tap), the sampled statistics by the opaque op (or
    masked, or every step), and the gradient tap on ``out``. ``shared``: the state of the tap's
    device (``cells.TAP_STATES``)."""
    if out.device != tap.forward_sum.device:  # (the cell's device: a guarded tensor, no attribute of its own)
        return  # a replica on another device (nn.DataParallel): its cells are not there
    local = out if type(out) is torch.Tensor else local_tensor(out)  # no call traced for plain tensors
    with torch.no_grad():
        if not checked:
            tap.forward_sum.add_(forward_sum(local))
        if shared.flags.every_step:  # (tap.forward_cells: [first call | output elements | output statistics])
            add_recorded_output(local, tap.forward_cells, shared.clock, shared.clock_tick, tap.records_outputs)
        elif host_branch.IN_USE:  # (its tap found by its row's zero-size view: no cells of its own in the graph)
            host_branch.mark_output(local, tap.grad_tap.row_key, shared.clock, shared.flags.key)
        else:
            _record_masked(tap, local, tap.forward_cells, shared)
    if out.requires_grad and not shared.flags.grads_through_function:
        out.register_hook(tap.on_traced_output_grad)


def _record_masked(tap: "OutputTap", local: torch.Tensor, cells: torch.Tensor, shared: DeviceTapState) -> None:
    """What ``host_branch.mark_output`` records, computed at every step and kept on sampled ones
    (a torch where the ops are not in use). Masked this way, the output statistics' float64
    squares and count over every output element cost the compiled MLP and Transformer ~1 point
    of their step (benchmarks/RESULTS.md, fifteenth session)."""
    count = shared.sampled_count
    # The clock is finite and non-negative, so a product keeps it or makes it 0, which the
    # first-call cell (zeroed at sampled steps, never negative) ignores.
    cells[0:1].clamp_min_(shared.clock * count)
    shared.clock.sub_(count * shared.clock_tick)
    if tap.records_outputs:
        (values,) = masked(shared, (registry.accumulate_all(local, cells.dtype),))
        cells[2:].add_(values)
        cells[1:2].add_(count * local.numel())


def forward_sum(local: torch.Tensor) -> torch.Tensor:
    """A compiled tap's sum of its output, in float32. Of a 2-D (or smaller) output, a (1,) reduction
    like the (1,) cell it is added into: a 0-d sum made inductor reinterpret its reused scalar buffer
    twice per layer in the wrapper (17 calls in the compiled MLP's forward, ~7 us each cold: 116 us
    of it). Larger outputs keep the 0-d sum: inductor may lay them out channels-last, where a
    flattened reduction indexes the storage elementwise (the compiled CNN's forward took 17.7 ms
    more; benchmarks/RESULTS.md, twenty-second session)."""
    if local.ndim <= 2:
        return local.flatten().sum(0, keepdim=True, dtype=torch.float32)
    return local.sum(dtype=torch.float32)
