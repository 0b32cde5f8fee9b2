"""Statistics of operands inductor may lay out anew (images, volumes), on sampled steps only,
inside compiled code: opaque ops that branch on the host's sampling flag at run time.

A ``torch.cond`` branch is compiled for its operand's traced strides, and inductor's layout
optimisation may hand a convolution's output or output gradient to it channels-last (or
contiguous where it was traced channels-last): the branch fails its stride assert at the first
sampled step (``grad_tap.RELAID_NDIM``). Computed at every step and masked instead, a conv net's
statistics cost it their full read at every step (the standard CNN compiled: 1.08x its unmonitored
step, against 1.03x for the floor of what the default must read; benchmarks/RESULTS.md).

The two ops here are that branch as custom ops: inductor hands them the buffer as laid out
(``flexible_layout``) and cannot see into them; at run time each reads its monitor's
``RecordingFlags.sampling`` (a Python bool on the host: no device read) and computes the
statistics with the eager code, in any layout, or returns zeros of the same shapes. They are
``cudagraph_unsafe``: a CUDA graph replays kernels without running Python, so inductor leaves
them out of its graphs. Compiled code reaches the flags by an int key equal across the monitor's
layers (a per-layer constant would make each block of a regionally compiled model its own graph).
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import torch

from .. import registry
from ..registry import outputs
from .grad_statistics import GradStatistics

if TYPE_CHECKING:
    from .taps import RecordingFlags

#: key -> the monitor's recording flags, while the monitor lives
_FLAGS: "weakref.WeakValueDictionary[int, RecordingFlags]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)
_TAGS = (torch.Tag.flexible_layout, torch.Tag.cudagraph_unsafe)


def register(flags: "RecordingFlags") -> int:
    """The key by which the ops below read ``flags`` (held weakly: a closed monitor's ops record nothing)."""
    key = next(_KEYS)
    _FLAGS[key] = flags
    return key


def _sampling(key: int) -> bool:
    flags = _FLAGS.get(key)
    return flags is not None and flags.sampling


@torch.library.custom_op("gradwatch::output_grad_deltas", mutates_args=(), tags=_TAGS)
def output_grad_deltas(grad: torch.Tensor, weights: torch.Tensor, flags_key: int, units: int, channel_first: bool,
                       unit_sums: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``GradStatistics.deltas`` of one output gradient on sampled steps, ``no_deltas`` on the others
    (the layer's facts as arguments: they are equal across layers of the same shape)."""
    stats = _grad_statistics(weights, units, channel_first, unit_sums, dtype)
    with torch.no_grad():
        return stats.deltas(grad, weights) if _sampling(flags_key) else stats.no_deltas(grad)


@output_grad_deltas.register_fake
def _output_grad_deltas_shapes(grad, weights, flags_key, units, channel_first, unit_sums, dtype):  # type: ignore[no-untyped-def]
    return _grad_statistics(weights, units, channel_first, unit_sums, dtype).no_deltas(grad)


@torch.library.custom_op("gradwatch::output_values", mutates_args=(), tags=_TAGS)
def output_values(output: torch.Tensor, flags_key: int, dtype: torch.dtype) -> torch.Tensor:
    """Every output statistic's accumulators of one output (``registry.accumulate_all``, exact) on
    sampled steps, zeros of that width on the others."""
    if not _sampling(flags_key):
        return output.new_zeros(outputs.accumulator_count() - 1, dtype=dtype)
    with torch.no_grad():
        return registry.accumulate_all(output, dtype)


@output_values.register_fake
def _output_values_shape(output, flags_key, dtype):  # type: ignore[no-untyped-def]
    return output.new_empty(outputs.accumulator_count() - 1, dtype=dtype)


def _grad_statistics(weights: torch.Tensor, units: int, channel_first: bool, unit_sums: bool,
                     dtype: torch.dtype) -> GradStatistics:  # fmt: skip
    stats = GradStatistics(units, channel_first, weights, dtype)
    stats.unit_sums = unit_sums
    return stats
