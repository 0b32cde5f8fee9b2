"""Statistics of operands inductor may lay out anew (images, volumes), on sampled steps only,
inside compiled code: opaque ops that branch on the host's sampling flag at run time.

A ``torch.cond`` branch is compiled for its operand's traced strides, and inductor's layout
optimisation may hand a convolution's output or output gradient to it channels-last (or
contiguous where it was traced channels-last): the branch fails its stride assert at the first
sampled step (``grad_tap.RELAID_NDIM``). Computed at every step and masked instead, a conv net's
statistics cost it their full read at every step (the standard CNN compiled: 1.08x its unmonitored
step, against 1.03x for the floor of what the default must read; through these ops 1.005x,
benchmarks/RESULTS.md).

The two ops here are that branch as custom ops: inductor hands them the buffer as laid out
(``flexible_layout``) and cannot see into them; at run time each reads its monitor's
``RecordingFlags.sampling`` (a Python bool on the host: no device read) and computes the
statistics (the functions the branch would trace, run eagerly: any layout), or returns zeros of
the same shapes. They are ``cudagraph_unsafe``: a CUDA graph replays kernels without running
Python, so inductor leaves them out of its graphs. Compiled code reaches the flags by an int key
equal across the monitor's layers (a per-layer constant would make each block of a regionally
compiled model its own graph). They also take every operand where ``torch.cond`` cannot be traced
(a frame with Hugging Face's KV cache, compiled autograd's graph). Where the ops cannot be defined
(:data:`DEFINED` False), those statistics are computed at every step and masked.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import TYPE_CHECKING

import torch

from .. import registry
from ..registry import outputs
from .grad_statistics import GradStatistics

if TYPE_CHECKING:
    from .taps import RecordingFlags

log = logging.getLogger("gradwatch")

#: key -> the monitor's recording flags, while the monitor lives
_FLAGS: "weakref.WeakValueDictionary[int, RecordingFlags]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def register(flags: "RecordingFlags") -> int:
    """The key by which the ops below read ``flags`` (held weakly: a closed monitor's ops record nothing)."""
    key = next(_KEYS)
    _FLAGS[key] = flags
    return key


def _sampling(key: int) -> bool:
    flags = _FLAGS.get(key)
    return flags is not None and flags.sampling


def _output_grad_deltas(grad: torch.Tensor, weights: torch.Tensor, flags_key: int, units: int, channel_first: bool,
                        unit_sums: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``GradStatistics.deltas`` of one output gradient on sampled steps, ``no_deltas`` on the others
    (the layer's facts are arguments: they are equal across layers of the same shape)."""
    stats = GradStatistics(units, channel_first, weights, dtype)
    stats.unit_sums = unit_sums
    if not _sampling(flags_key):
        return stats.no_deltas(grad)
    with torch.no_grad():
        return stats.deltas(grad, weights)


def _output_grad_deltas_shapes(grad: torch.Tensor, weights: torch.Tensor, flags_key: int, units: int,
                               channel_first: bool, unit_sums: bool,
                               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return GradStatistics(units, channel_first, weights, dtype).no_deltas(grad)


def _output_values(output: torch.Tensor, flags_key: int, dtype: torch.dtype) -> torch.Tensor:
    """Every output statistic's accumulators of one output (``registry.accumulate_all``, exact) on
    sampled steps, zeros of that width on the others."""
    if not _sampling(flags_key):
        return output.new_zeros(outputs.declared_accumulators(), dtype=dtype)
    with torch.no_grad():
        return registry.accumulate_all(output, dtype)


def _output_values_shape(output: torch.Tensor, flags_key: int, dtype: torch.dtype) -> torch.Tensor:
    return output.new_empty(outputs.declared_accumulators(), dtype=dtype)


_SCHEMAS = {
    "output_grad_deltas": (
        "(Tensor grad, Tensor weights, int flags_key, int units, bool channel_first, bool unit_sums,"
        " ScalarType dtype) -> (Tensor, Tensor)", _output_grad_deltas, _output_grad_deltas_shapes),
    "output_values": ("(Tensor output, int flags_key, ScalarType dtype) -> Tensor", _output_values,
                      _output_values_shape),
}  # fmt: skip


def _define_ops() -> "torch.library.Library | None":
    """The ops in the ``gradwatch`` namespace, one Python kernel each for every backend
    (``CompositeExplicitAutograd``: they run with grad off). Not ``torch.library.custom_op``: its
    Python wrappers cost ~75 us a call against ~25 here. Still dearer than a branch of
    ``torch.cond`` (~11 us), so only images take them (the standard MLP compiled with all its
    statistics through these ops: 1.037 its read floor, against 1.020 with ``torch.cond``; with
    ``custom_op``, 1.064). None before torch 2.4 (no ``register_fake``; releases before 2.13 mask
    the statistics anyway: ``_compat.COND_IN_HOOKS``), and where a second copy of gradwatch in the
    process defined them first (their kernels would read that copy's flags)."""
    if not hasattr(torch.library, "register_fake"):
        return None
    tags = tuple(getattr(torch.Tag, name) for name in ("flexible_layout", "cudagraph_unsafe")
                 if hasattr(torch.Tag, name))  # fmt: skip
    try:
        library = torch.library.Library("gradwatch", "DEF")
        for name, (schema, kernel, shapes) in _SCHEMAS.items():
            library.define(name + schema, tags=tags)
            library.impl(name, kernel, "CompositeExplicitAutograd")
            torch.library.register_fake(f"gradwatch::{name}", shapes, lib=library)
    except RuntimeError as exc:  # the namespace is taken
        log.debug("gradwatch: statistics torch.cond cannot take are masked inside compiled code (%s)", exc)
        return None
    return library


_LIBRARY = _define_ops()  # kept: the registrations live as long as this object
#: whether the ops exist (else ``grad_tap.on_sampled_steps`` masks images' statistics)
DEFINED = _LIBRARY is not None
output_grad_deltas = torch.ops.gradwatch.output_grad_deltas.default if DEFINED else None
output_values = torch.ops.gradwatch.output_values.default if DEFINED else None
