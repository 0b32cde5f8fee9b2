"""A monitor's state for checkpoints: what a resumed run needs, bounded in size."""

from __future__ import annotations

from typing import Any

_STATE_VERSION = 1


def saved_state(next_step: int, layers: list[str], checks: Any, tracker: Any, board: Any) -> dict[str, Any]:
    """The step count, detector baselines and alert state; the log folder that has the dashboard
    layout (the layout belongs to a folder: ``board`` is the TensorBoard sink, or None)."""
    return {
        "version": _STATE_VERSION, "next_step": next_step, "layers": list(layers),
        "checks": checks.state_dict(), "tracker": tracker.state_dict(),
        "layout_dir": board.layout_dir if board is not None else None,
    }  # fmt: skip


def restore_state(state: dict[str, Any], checks: Any, tracker: Any, board: Any) -> int:
    """Load :func:`saved_state` output into ``checks``, ``tracker`` and ``board``; returns the next
    step number. Raises ValueError for anything that is not such a state."""
    if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
        raise ValueError("not a gradwatch GradMonitor state_dict (or from an incompatible version)")
    checks.load_state_dict(state["checks"])
    tracker.load_state_dict(state["tracker"])
    if board is not None:
        board.restore_layout_dir(state.get("layout_dir"))
    return int(state["next_step"])
