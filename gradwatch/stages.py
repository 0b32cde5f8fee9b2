"""The stages of one attached monitor, connected in the order data flows through them (docs/design.md):
hooks -> buffer (the recorder, built first) -> flush (the window reader) -> detectors -> sinks,
with the step pipeline driving them. ``GradMonitor`` is the facade over one ``Stages``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .capture.hooks import HookSet
from .capture.layers import LayerSpec, frozen_layers
from .capture.recorder import Recorder
from .capture.watch import ModelWatch
from .config import HealthConfig
from .detect.assemble import Detection, assemble
from .distributed.agreement import agree_on_layout
from .distributed.collectives import Collectives
from .failures import FailureLog
from .flush.reader import WindowReader
from .pipeline import StepPipeline
from .sinks.outputs import Outputs


@dataclass
class Stages:
    """What a monitor runs, stage by stage, once attached.

    Args:
        names: the layers the windows hold (every rank's, when ranks hold different layers).
        detection: the rules, the alert tracker and the per-step judge.
        watch: the checks of how the model is used (moved parameters, missing backward, ...).
        outputs: the sinks (the writing rank's; none elsewhere).
        pipeline: what step() and flush() run.
        hooks: the forward hooks on the model, until :meth:`detach`.
        is_writer: whether this rank writes (rank 0).
    """

    names: list[str]
    detection: Detection
    watch: ModelWatch
    outputs: Outputs | None
    pipeline: StepPipeline
    hooks: HookSet | None
    is_writer: bool

    def detach(self, recorder: Recorder) -> None:
        """Remove every hook and thread, and every reference to the model (idempotent)."""
        hooks, outputs = self.hooks, self.outputs
        self.hooks, self.outputs = None, None
        if hooks is not None:
            hooks.remove()
        recorder.drop_references()  # the optimizer hooks too
        self.watch.drop_references()
        if outputs is not None:
            outputs.close()
        self.pipeline.layers, self.pipeline.optimizer = [], None


def connect(model: nn.Module, layers: list[LayerSpec], recorder: Recorder, collectives: Collectives,
            output_shares: Any, failures: FailureLog, config: HealthConfig, *, optimizer: Any, scaler: Any,
            flush_every: int, histograms: bool, include: Any, exclude: Any, logdir: Any,
            writer: Any) -> Stages:  # fmt: skip
    """Agree on the layout across ranks, then connect the stages after the recorder; the hooks go on
    last. A failure part-way leaves no hook and no writer thread (then raises)."""
    mesh = agree_on_layout(collectives, layers, recorder, output_shares, failures)
    names = list(mesh.names) if mesh is not None else [layer.name for layer in layers]
    is_writer = collectives.rank == 0  # only rank 0 writes
    detection = assemble(config, names, optimizer, recorder, mesh is not None, failures, scaler, is_writer)
    watch = ModelWatch(recorder, frozen_layers(model, include, exclude), layers)
    outputs = Outputs(failures, str(logdir) if is_writer and logdir else None, writer if is_writer else None,
                      config.report_thresholds(), {layer.name: type(layer.module).__name__ for layer in layers})  # fmt: skip
    try:
        pipeline = StepPipeline(recorder, watch, WindowReader(recorder, collectives, failures, mesh), detection,
                                outputs, config, failures, flush_every, scaler, histograms)  # fmt: skip
        pipeline.layers, pipeline.optimizer = layers, optimizer
        stages = Stages(names, detection, watch, outputs, pipeline, None, is_writer)
        stages.hooks = HookSet(model, layers, recorder.cells.taps, recorder.layout.forward_aliases)
        watch.model_code = stages.hooks.model_code
        recorder.flags.watch_cache_switch(model)
    except BaseException:
        watch.drop_references()
        outputs.close()
        raise
    return stages
