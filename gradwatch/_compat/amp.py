"""GradScaler state gradwatch reads without a host sync (private fields, each with its fallback)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("gradwatch")

# torch.amp.GradScaler has no public, sync-free way to read its scale or whether it unscaled an
# optimizer: get_scale() copies the scale to the host, and unscale_'s bookkeeping is private.
# Each read below names the private field and falls back (with one WARNING) where it is gone.
_warned_scaler: set[str] = set()


def _warn_scaler_once(what: str, fallback: str) -> None:
    if what not in _warned_scaler:
        _warned_scaler.add(what)
        log.warning("gradwatch: this torch's GradScaler has no %s; %s", what, fallback)


def scaler_scale(scaler: Any) -> Any:
    """The scale as a device tensor (``GradScaler._scale``: get_scale() would synchronise); None
    before the first scaled backward. Fallback: ``get_scale()`` (a host float; one sync per step)."""
    if hasattr(scaler, "_scale"):
        return scaler._scale
    _warn_scaler_once("_scale tensor", "gradwatch reads get_scale() at each step (one host sync per step)")
    import torch

    return torch.tensor(float(scaler.get_scale()))


def scaler_unscaled(scaler: Any, optimizer: Any = None) -> bool | None:
    """Whether ``scaler.unscale_(optimizer)`` ran for this step (``GradScaler._per_optimizer_states``
    stage UNSCALED, or STEPPED: ``scaler.step`` unscales first; an optimizer the scaler has not seen
    this step is not unscaled). ``optimizer=None``: whether any optimizer was. None when this
    torch's GradScaler has no such field (one WARNING)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        _warn_scaler_once(
            "_per_optimizer_states", "gradwatch cannot tell whether gradients were unscaled and takes them as unscaled"
        )
        return None
    done = ("UNSCALED", "STEPPED")
    if optimizer is None:
        return any(getattr(state.get("stage"), "name", "") in done for state in states.values())
    state = states.get(id(getattr(optimizer, "optimizer", optimizer))) or {}
    return getattr(state.get("stage"), "name", "") in done
