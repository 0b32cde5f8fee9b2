"""Checks of the knobs a monitor is built with: every wrong value fails at once, naming the remedy."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from .config import HealthConfig

log = logging.getLogger("gradwatch")

#: detail -> every how many steps (from each window's first) every statistic is recorded.
#: "standard" records grad_norm and the non-finite checks at every step and the rest
#: (grad_max, out_grad_norm, dead-unit evidence) at steps 0, 25, ... of each window.
DETAILS = {"standard": 25, "full": 1}


def check_settings(flush_every: Any, config: Any, detail: Any) -> HealthConfig:
    """Check the knobs GradMonitor and the callbacks share; returns the HealthConfig to use.

    The callbacks call it when they are built, so a wrong value fails at once, with the same
    message, not when training starts.
    """
    if not isinstance(flush_every, int) or isinstance(flush_every, bool) or flush_every < 1:
        raise ValueError(f"flush_every must be an int >= 1 (optimizer steps per flush), got {flush_every!r}")
    if config is not None and not isinstance(config, HealthConfig):
        raise TypeError(f"config must be a gradwatch.HealthConfig, got {type(config).__name__}")
    if detail not in DETAILS:
        raise ValueError(
            f"detail must be one of {list(DETAILS)}: 'standard' (the default, meant to stay on: every step "
            f"has grad_norm and the non-finite checks, some steps every statistic) or 'full' (every "
            f"statistic at every step), got {detail!r}"
        )
    return config if config is not None else HealthConfig()


def check_callback(callback: Any) -> None:
    """A metrics callback (None: none) must be callable as ``callback(metrics, step)``."""
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable as callback(metrics: dict, step: int), got {callback!r}")


def check_outputs(logdir: Any, writer: Any, scaler: Any, sync_dist: Any) -> None:
    """The output and distribution arguments of GradMonitor; raises ValueError/TypeError naming the fix."""
    if logdir is not None and writer is not None:
        raise ValueError("pass either logdir (gradwatch owns a writer) or writer (yours), not both")
    if scaler is not None and not (hasattr(scaler, "is_enabled") and hasattr(scaler, "get_scale")):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if sync_dist is not None and not isinstance(sync_dist, bool):
        raise TypeError(f"sync_dist must be True, False or None (automatic), got {sync_dist!r}")


def check_device(device: Any) -> None:
    """The model's parameters must be materialised."""
    if device.type == "meta":
        raise ValueError(
            "the model's parameters are on the meta device (not materialised yet): create the monitor "
            "after materialising the model (model.to_empty(device=...) and initialisation, or your "
            "framework's deferred initialisation)"
        )


def check_step_number(global_step: Any) -> int | None:
    """``step(global_step)``: None or an int (a numpy or 0-d tensor integer is taken as its value)."""
    if global_step is None or (isinstance(global_step, int) and not isinstance(global_step, bool)):
        return global_step
    if hasattr(global_step, "__index__") and not isinstance(global_step, bool):
        return int(global_step.__index__())
    raise TypeError(
        f"step(global_step) takes an int (the optimizer step number) or None (count from 0), got "
        f"{type(global_step).__name__} {global_step!r}"
    )


def warn_about_wrappers(model: nn.Module) -> None:
    """One WARNING at attach for the wrappers whose statistics gradwatch cannot make whole."""
    if any(isinstance(m, nn.DataParallel) for m in model.modules()):
        log.warning(
            "gradwatch: nn.DataParallel runs copies of the model on each GPU; parameter-gradient statistics "
            "(grad_norm, grad_max, nonfinite, update_ratio) are of the summed gradients and exact, but "
            "out_grad_norm, dead units and the forward non-finite check cover the copy on the first GPU only "
            "(its share of the batch). Use DistributedDataParallel for all of them."
        )


# Per step: three float64 device statistics per parameter tensor (param_sq, param_max,
# param_nonfinite) and one host count (param_present, copied into the buffer at flush); five per
# layer (out_grad's sum of squares, calls and samples, fwd_sum, fwd_order).
_BYTES_PER_STEP_AND_TENSOR = 3 * 8 + 8
_BYTES_PER_STEP_AND_LAYER = 5 * 8
_MAX_WINDOW_BYTES = 1 << 30


def check_window_size(flush_every: int, layers: int, tensors: int) -> None:
    """A window is kept per step until it is flushed: refuse one that cannot fit."""
    size = flush_every * (layers * _BYTES_PER_STEP_AND_LAYER + tensors * _BYTES_PER_STEP_AND_TENSOR)
    if size > _MAX_WINDOW_BYTES:
        raise ValueError(
            f"flush_every={flush_every} with {layers} monitored layers would keep {size / (1 << 30):.1f} GiB "
            f"of per-step statistics between flushes (limit 1 GiB); use a smaller flush_every "
            f"(statistics are buffered per step and written at each flush)"
        )
