"""Host-side view of one flushed window of statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..registry import outputs


@dataclass
class Window:
    """The statistics of up to ``flush_every`` steps, on the host, as numpy arrays.

    Arrays indexed ``[step, layer]`` hold NaN where a statistic does not exist
    (a layer that got no gradient that step, an output gradient never seen).
    """

    steps: list[int]
    layers: list[str]
    grad_norm: np.ndarray
    grad_max: np.ndarray
    nonfinite: np.ndarray
    out_grad_norm: np.ndarray
    #: bool [step, layer]: an output of the layer was NaN/Inf at this step, for the first time in the window
    fwd_nonfinite: np.ndarray
    has_grad: np.ndarray  # bool [step, layer]: the layer's parameters got a gradient
    out_seen: np.ndarray  # bool [step, layer]: an output gradient reached the layer
    unit_counts: np.ndarray  # [layer] number of units (0 until the layer ran)
    param_numel: np.ndarray  # [layer] number of gradient elements, for RMS
    dead_fraction: np.ndarray  # [layer], NaN where no output gradient was seen in the window
    global_grad_norm: np.ndarray  # [step]
    step_orders: list[tuple[list[int], list[int]]] = field(default_factory=list)
    skipped: np.ndarray | None = None  # bool [step]: GradScaler skipped the optimizer step
    #: [layer] samples (images for convolutions, rows for the others; over calls, micro-batches
    #: and ranks) behind each layer's dead_fraction in this window
    rows_seen: np.ndarray | None = None
    #: [layer] distinct steps behind rows_seen
    steps_judged: np.ndarray | None = None
    #: [layer] bool per unit: its output gradient was not zero for some sample (None: not judged)
    unit_alive: list[np.ndarray | None] | None = None
    #: bool [layer]: some rank recorded the rest of this window in full to confirm the layer's dead units
    dead_suspected: np.ndarray | None = None
    #: bool [step]: every statistic was recorded (detail="standard" samples some steps;
    #: the others have grad_norm, the forward check and no grad_max / output gradients)
    sampled: np.ndarray | None = None
    #: bool [step]: ``nonfinite`` holds exact counts (else only whether grad_norm is finite)
    nonfinite_counted: np.ndarray | None = None
    #: optimizer steps at which the update-to-weight ratio was measured (with an optimizer)
    update_steps: list[int] = field(default_factory=list)
    #: [update step, layer] ||w_after - w_before|| / ||w_before|| of the layer's own parameters
    update_ratio: np.ndarray | None = None
    #: [update step, layer] the same over the layer's weight matrices and kernels only (>= 2-D),
    #: what the update_ratio check judges; NaN for layers without one
    judged_update_ratio: np.ndarray | None = None
    #: [update step, layer] RMS of those weights before the step
    judged_weight_rms: np.ndarray | None = None
    #: [step, layer] the judged ratio estimated at every optimizer step from a fixed sample of about
    #: 1024 elements of each weight matrix (16 runs of 64) (NaN: no sample, or its step not measured)
    estimated_update_ratio: np.ndarray | None = None
    #: [step, layer] RMS of those samples before the step
    estimated_weight_rms: np.ndarray | None = None
    #: name -> table of each declared statistic without a field of its own (registry/statistics.py):
    #: the output statistics ([step, layer], NaN where not recorded), and any added since
    extra_stats: dict[str, np.ndarray] = field(default_factory=dict)

    def table(self, name: str) -> np.ndarray | None:
        """The table of a declared statistic (``registry/statistics.py``) by name (None: none this window)."""
        return self.extra_stats[name] if name in self.extra_stats else getattr(self, name, None)

    @property
    def output_stats(self) -> dict[str, np.ndarray]:
        """name -> [step, layer] each output statistic (registry/outputs.py, read as it is now); NaN
        where not recorded."""
        return {s.name: self.extra_stats[s.name] for s in outputs.OUTPUT_STATISTICS if s.name in self.extra_stats}

    @property
    def grad_rms(self) -> np.ndarray:
        """Root-mean-square gradient per element: independent of the layer's size."""
        return self.grad_norm / np.sqrt(np.maximum(self.param_numel, 1))[None, :]
