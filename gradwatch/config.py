"""HealthConfig: every threshold of the health checks, with documented defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ALERT_KINDS = ("vanishing", "exploding", "dead_units", "nonfinite", "update_ratio")


@dataclass
class HealthConfig:
    """Thresholds of gradwatch's health checks (see README, "Health checks").

    The defaults are chosen so that ordinary healthy training raises nothing.
    """

    #: A layer is vanishing when the window median of its gradient RMS (L2 norm
    #: divided by sqrt(#elements), so independent of its size) is below this ...
    vanishing_abs_rms: float = 1e-10
    #: ... or below this fraction of the strongest layer's RMS in the same steps.
    vanishing_rel_rms: float = 1e-5
    #: Exploding: a layer's grad_norm above this absolute ceiling at any step ...
    exploding_abs_norm: float = 1e5
    #: ... or above this factor times the layer's recent level (the larger of the largest of
    #: its last 10 calm steps and the median of its last 50): judged against where the run is
    #: now, not its all-time peak, so a spike after a high start that settled is still flagged.
    exploding_factor: float = 10.0
    #: Steps before the relative exploding test starts (the recent level needs history).
    exploding_warmup_steps: int = 20
    #: ... and at any step, warm-up included: a grad_norm at least this many times the
    #: previous calm step's is exploding (a jump, not smooth growth). Neither relative test calls a
    #: value exploding that is no larger than the largest of the column's last 50 calm values (a
    #: return to where it has been).
    exploding_jump: float = 1e4
    #: ... where a column's own calm steps vary widely (batch size 1-2, a rare class, dropout), the
    #: relative ceiling widens to its median x exp(this x its step-to-step log-spread: the standard
    #: deviation of consecutive log-ratios of its last 50 calm values / sqrt(2)), never beyond
    #: ``exploding_factor`` x the largest of those values nor ``exploding_jump`` x that median: a layer
    #: whose gradient normally moves 20x between steps is not exploding at 20x (a z-score in log
    #: space, as production rules judge spikes). 0 turns the widening off.
    exploding_spread_z: float = 5.0
    #: |output gradient| at or below this counts as zero for dead units.
    dead_eps: float = 0.0
    #: A dead_units alert fires when a layer's dead_fraction reaches this.
    dead_fraction: float = 0.5
    #: Layers with fewer units than this are not judged for dead units.
    dead_min_units: int = 4
    #: Dead units are judged on at least this many samples (over calls, micro-batches and ranks):
    #: images for convolutions and per-channel norms (never their positions), rows of the
    #: (-1, units) view for other layers (tokens); a layer that saw fewer in a window carries its
    #: evidence into the next windows until it has them.
    dead_min_samples: int = 32
    #: Vanishing with an optimizer that normalises its step (Adam family, RMSprop, ...): only the
    #: absolute floor applies. None: decided from the monitor's optimizer (none given: False).
    normalised_optimizer: bool | None = None
    #: A condition recovers after this many consecutive flushes clearly on the healthy side
    #: (values near a threshold keep it active: one condition, not an alert per crossing).
    recovery_flushes: int = 2
    #: update_ratio (with an optimizer): a layer whose weights change by more than this
    #: fraction of their norm in one optimizer step ...
    update_ratio_max: float = 0.2
    #: ... at this many consecutive measured steps is flagged (learning rate far too high).
    update_ratio_steps: int = 2
    #: Weight matrices with a smaller RMS than this are still near a zero or tiny
    #: initialisation: their relative change says nothing about the learning rate yet.
    update_ratio_min_weight_rms: float = 1e-3
    #: While a condition persists it is logged again every this many flushes (0: never).
    remind_every: int = 10
    #: A GradScaler that skips this many optimizer steps in a row (non-finite gradients that do
    #: not go away as its scale falls; a recalibration skips a handful) raises ``nonfinite``.
    scaler_skips_max: int = 25
    #: Alert kinds that stop training (GradMonitor raises GradientHealthError).
    stop_on: frozenset[str] = field(default_factory=frozenset)

    def report_thresholds(self) -> dict[str, float]:
        """The thresholds ``gradwatch report`` explains values by (written beside the layer list)."""
        names = ("dead_fraction", "dead_min_samples", "dead_min_units", "update_ratio_max", "update_ratio_steps")
        return {name: getattr(self, name) for name in names}

    def __post_init__(self) -> None:
        def finite_positive(name: str, allow_zero: bool = False) -> None:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"HealthConfig.{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
                need = ">= 0" if allow_zero else "> 0"
                raise ValueError(f"HealthConfig.{name} must be a finite number {need}, got {value!r}")

        finite_positive("vanishing_abs_rms", allow_zero=True)
        finite_positive("vanishing_rel_rms", allow_zero=True)
        if self.vanishing_rel_rms >= 1:
            raise ValueError(
                f"HealthConfig.vanishing_rel_rms must be < 1 (a fraction of the strongest "
                f"layer), got {self.vanishing_rel_rms!r}"
            )
        finite_positive("exploding_abs_norm")
        finite_positive("exploding_jump")
        if self.exploding_jump <= 1:
            raise ValueError(f"HealthConfig.exploding_jump must be > 1, got {self.exploding_jump!r}")
        if self.normalised_optimizer is not None and not isinstance(self.normalised_optimizer, bool):
            raise TypeError(
                f"HealthConfig.normalised_optimizer must be True, False or None, got {self.normalised_optimizer!r}"
            )
        finite_positive("exploding_factor")
        finite_positive("exploding_spread_z", allow_zero=True)
        if self.exploding_factor <= 1:
            raise ValueError(
                f"HealthConfig.exploding_factor must be > 1, got {self.exploding_factor!r}"
            )
        finite_positive("dead_eps", allow_zero=True)
        finite_positive("dead_fraction")
        if self.dead_fraction > 1:
            raise ValueError(
                f"HealthConfig.dead_fraction is a fraction in (0, 1], got {self.dead_fraction!r}"
            )
        finite_positive("update_ratio_max")
        finite_positive("update_ratio_min_weight_rms", allow_zero=True)
        counts = {"update_ratio_steps": 1, "recovery_flushes": 1, "exploding_warmup_steps": 0,
                  "dead_min_units": 0, "dead_min_samples": 0, "remind_every": 0,
                  "scaler_skips_max": 1}  # name: minimum
        for name, minimum in counts.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"HealthConfig.{name} must be an int >= {minimum}, got {value!r}")
        if isinstance(self.stop_on, str):
            self.stop_on = frozenset([self.stop_on])
        stop_on = frozenset(self.stop_on)
        unknown = sorted(stop_on - set(ALERT_KINDS))
        if unknown:
            raise ValueError(
                f"HealthConfig.stop_on has unknown alert kind(s) {unknown}; "
                f"choose from {list(ALERT_KINDS)}"
            )
        self.stop_on = stop_on


def _document_fields(cls: type) -> None:
    """Append an "Attributes:" section to ``cls.__doc__`` from the ``#:`` comments above each field,
    so that ``help(HealthConfig)`` lists every threshold, its default and its meaning (one source)."""
    import dataclasses
    import inspect

    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source (a frozen or stripped install): the class doc as it is
        return
    notes: dict[str, str] = {}
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
        elif ":" in stripped and pending and not stripped.startswith(("def ", "#", '"')):
            notes[stripped.split(":")[0].strip()] = " ".join(pending)
            pending = []
        elif not stripped.startswith("#"):
            pending = []
    entries = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        entries.append(f"        {f.name} (default {default!r}): {notes.get(f.name, '')}")
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Attributes:\n" + "\n".join(entries) + "\n"


_document_fields(HealthConfig)
