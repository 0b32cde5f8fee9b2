"""Building a monitor's capture stage: the recorder (buffer, taps, parameter statistics) and the
optimizer hooks of update_ratio, wired to a monitor they must not keep alive."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

from .layers import LayerSpec
from .recorder import Recorder
from .updates import NOT_ON_FLAT_PARAMETERS, UpdateRatio, steps_flat_parameters


def build_recorder(monitor: Any, layers: list[LayerSpec], flush_every: int, device: torch.device, *,
                   scale_source: Callable[[], torch.Tensor | None] | None, project_units: bool, world_size: int,
                   optimizer: Any, sample_every: int,
                   reduce_partials: Callable[[list[torch.Tensor]], list[torch.Tensor] | None] | None,
                   ) -> Recorder:  # fmt: skip
    """The recorder of ``layers`` and, with ``optimizer``, the update-ratio hooks writing into it
    (``recorder.updates``, which the recorder owns: it replaces and removes them).

    The hooks hold the monitor through a weak reference: dropping the monitor removes its hooks.
    ``monitor`` must have ``_closed`` and ``_next_step`` (the step an update belongs to).
    """
    if optimizer is not None and steps_flat_parameters([p for layer in layers for p in layer.params]):
        # Said, not raised: the Lightning callback passes the optimizer by itself.
        logging.getLogger("gradwatch").warning("gradwatch: %s. Every other statistic is recorded", NOT_ON_FLAT_PARAMETERS)
        optimizer = None
    recorder = Recorder(
        layers, flush_every, device, scale_source, project_units=project_units, world_size=world_size,
        track_updates=optimizer is not None, sample_every=sample_every, reduce_partials=reduce_partials,
    )  # fmt: skip
    if optimizer is not None:
        recorder.replace_updates(build_updates(monitor, recorder, optimizer, flush_every))
    return recorder


def replacement_updates(monitor: Any, recorder: Recorder, optimizer: Any, flush_every: int) -> UpdateRatio:
    """The update-ratio hooks of another optimizer for an attached monitor (``GradMonitor.set_optimizer``).

    Raises:
        ValueError: the recorder keeps no update states (the monitor was created without
            ``optimizer=``, or on FSDP1's flat parameters), or the optimizer holds none of its parameters.
        TypeError: not an optimizer.
    """
    if steps_flat_parameters(recorder.param_stats.params):
        raise ValueError(NOT_ON_FLAT_PARAMETERS)
    if recorder.updates is None or not recorder.layout.track_updates:
        raise ValueError(
            "this monitor was created without optimizer=, so it keeps no update_ratio states: close() it "
            "and create GradMonitor(model, optimizer=...) to measure update_ratio"
        )
    return build_updates(monitor, recorder, optimizer, flush_every)


def build_updates(monitor: Any, recorder: Recorder, optimizer: Any, flush_every: int) -> UpdateRatio:
    """The update-ratio hooks of ``optimizer``, writing into ``recorder`` (declared with updates)."""
    monitor_ref = weakref.ref(monitor)

    def live() -> bool:
        current = monitor_ref()
        return current is not None and not current._closed

    def write_update(columns: Any, index: torch.Tensor, update_sq: torch.Tensor, weight_sq: torch.Tensor) -> None:
        if live():
            recorder.update_rows.write(monitor_ref()._next_step - 1, columns, index, update_sq, weight_sq)

    def write_estimate(update_norms: torch.Tensor, weight_norms: torch.Tensor) -> None:
        if live():
            recorder.update_rows.write_estimate(recorder.slot - 1, update_norms, weight_norms)

    return UpdateRatio(
        optimizer, recorder.param_stats.params, recorder.param_stats.param_layer, flush_every, write_update,
        recorder.hook_failed, recorder.buffer.dtype, write_estimate=write_estimate,
        sample_columns=recorder.layout.sample_columns,
    )  # fmt: skip

