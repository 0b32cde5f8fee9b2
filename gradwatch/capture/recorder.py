"""Step bookkeeping: the taps' cells and the parameter gradients into the buffer row of each step.

Nothing here reads a device value back to the host between flushes: at ``record_step`` the
step's cells (see ``capture.py``) are copied into the step's row of the declared buffer
(see ``layout.py``) and zeroed, the parameter-gradient statistics are written next to them
(``param_stats.py``), and the row advances. At a flush the buffer is reduced across ranks,
copied to the host once, and decoded (``decode.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .cell_moves import CellMoves
from .cells import Cells
from .hook_failures import HookFailures
from .host_cells import HostCellMoves
from ..flush.decode import build_window
from .layers import LayerSpec
from ..registry.states import (
    FWD_SUM, OUT_GRAD, PARAM_MAX, PARAM_NONFINITE, PARAM_PRESENT, PARAM_SQ, STEP_FAILED,
    STEP_UNSAMPLED, UNIT_ACC, DEAD_SUSPECTED,
)  # fmt: skip
from .layout import Layout
from .param_stats import ParamStats
from .reductions import StepRows
from .per_step_rows import PerStepRows
from .update_rows import UpdateRows
from ..flush.window import Window


class Recorder:
    """Collects one window of statistics for a fixed list of layers."""

    def __init__(
        self,
        layers: list[LayerSpec],
        flush_every: int,
        device: torch.device,
        scale_source: Callable[[], torch.Tensor | None] | None,
        project_units: bool = True,
        world_size: int = 1,
        track_updates: bool = False,
        sample_every: int = 1,
        reduce_partials: Callable[[list[torch.Tensor]], list[torch.Tensor] | None] | None = None,
    ) -> None:
        self.flush_every = flush_every
        self.device = device
        self._scale_source = scale_source
        self.param_stats = ParamStats(layers, device, world_size, reduce_partials)
        self.layout = Layout(layers, self.param_stats, flush_every, device, track_updates, sample_every)
        self.names = self.layout.names
        self.buffer = buffer = self.layout.buffer
        self._dtype = buffer.dtype
        self._host = buffer.host
        #: the accelerators' path: each step's gradient norms beside the taps' forward sums in one
        #: device stage, copied to the host whole at every step (``per_step_rows.py``); None elsewhere
        self.per_step_rows = _per_step_rows(self.layout, self.param_stats, layers)
        staged = self.per_step_rows
        self.cells = Cells(layers, self.layout.unit_count, forward_sums=staged.forward if staged else None)
        # True: dead units by a random projection (exact zero test, dead_eps == 0);
        # False: per-unit sums of squares, compared with dead_eps.
        self.project_units = project_units
        self.cells.set_unit_sums(not project_units)
        self.flags = self.cells.flags
        self.flags.every_step = bool(self.layout.planned_slots.all())  # detail="full"
        self.slot = 0
        #: the update-ratio measurements' rows in the buffer (``update_rows.py``)
        self.update_rows = UpdateRows(buffer, self.param_stats, flush_every)
        #: the optimizer hooks measuring update_ratio into this buffer (``capture.updates.UpdateRatio``), or None
        self.updates: Any = None
        self._hook_failures = HookFailures()
        # Views made once: indexing and slicing are an op each per call.
        self._units_window = buffer[UNIT_ACC]
        self._present_rows = list(self._host[PARAM_PRESENT])  # numpy views of each step's row, made once
        self._unsampled_row = self._host[STEP_UNSAMPLED]  # (a view made once, as the rows above)
        self._moves = [CellMoves(cells, self.layout, self.param_stats.cpu_fast, self.per_step_rows)
                       for cells in self.cells.devices]  # fmt: skip
        self._host_moves = HostCellMoves(self.layout, self.cells.host, numpy_rows=self.param_stats.counts_every_step)
        # Unsampled steps leave max |g| (and, on accelerators, the non-finite count) out.
        self._param_rows = _step_rows(buffer, self.per_step_rows, self.layout.planned_slots)
        self._full_rows = _step_rows(buffer, self.per_step_rows, np.ones(flush_every, dtype=bool))  # every statistic
        # The layers whose taps check their own forward (an alias's is its attention's: never written)
        aliases = self.layout.forward_aliases
        self._checks_own = np.ones(len(layers), dtype=bool)
        self._checks_own[aliases.alias] = False
        self._forward_checks = int(self._checks_own.sum())
        #: after ``record_step`` on an unsampled step: the step's sum of squared gradient norms where
        #: the host check of the reduction found every gradient present, finite and not tiny and no
        #: scale was divided out (``ParamStats.checked_total``), for the per-step judgement's calm
        #: case (``detect.per_step.StepJudge.judge_calm``); None otherwise
        self.calm_total: float | None = None

    @property
    def update_steps(self) -> list[int]:
        """The optimizer step each update row of this window describes."""
        return self.update_rows.steps

    @property
    def nbytes(self) -> int:
        """Bytes gradwatch holds on the devices: the declared buffer, the per-step stage's norms, the
        cells, the projection weights."""
        staged = self.per_step_rows
        return self.buffer.nbytes + self.cells.nbytes + (staged.nbytes if staged is not None else 0)

    # ------------------------------------------------------------- controls
    @property
    def active(self) -> bool:
        return self.flags.active

    @active.setter
    def active(self, value: bool) -> None:
        self.flags.active = bool(value)

    def hook_failed(self, where: str, exc: BaseException) -> None:
        """A hook raised: warn once per layer and kind of error, and keep training going (``hook_failures.py``)."""
        self._hook_failures.report(where, exc)

    # ------------------------------------------------------------------ step
    def record_step(self, params_scaled: bool = False) -> None:
        """Write this step's statistics into the current row and advance; no host sync.

        ``params_scaled``: the parameter gradients still carry the loss scale
        (an optimizer that unscales inside its own step, e.g. fused Adam).
        The row advances even when recording fails, so that every rank flushes
        at the same step; a failed row is marked and left out of the window.
        """
        slot = self.slot
        flags = self.flags
        sampled = flags._sampling  # (the property's value, read without a call: RecordingFlags)
        full = self.layout.sampled_at[slot]  # (``is_sampled`` as a list, to slot flush_every: no call a step)
        self._unsampled_row[slot] = 0.0 if full else 1.0
        self.calm_total = None
        try:
            if flags.failed:
                self._report_tap_failure()
            scale = self._scale_source() if self._scale_source is not None else None
            if scale is not None:
                scale = scale.to(self._dtype)
            for moves in self._moves:
                moves.into_row(slot, sampled, scale, self._units_window, not self.project_units)
            if sampled:
                self._host_moves.into_row(slot)
            rows = (self._full_rows if full else self._param_rows)[slot]
            # the parameter-gradient statistics (with per-step rows: norms in the stage, ``per_step_rows.py``)
            if self.per_step_rows is None:
                self.param_stats.record(rows, self._present_rows[slot])
            else:
                self.per_step_rows.record(self.param_stats, rows, self._present_rows[slot])
            if params_scaled and scale is not None:
                rows.sq.div_(scale if self.per_step_rows is not None else scale.square())  # norms there
                if rows.max is not None:
                    rows.max.div_(scale)
            elif not full:
                self.calm_total = self.param_stats.checked_total
        except Exception:
            self._host[STEP_FAILED][slot] = 1
            raise
        finally:
            if self.per_step_rows is not None:  # to the host, and the forward sums zeroed where needed
                self.per_step_rows.finish(slot, flags.forward_writes == self._forward_checks, self._unwritten)
            flags.forward_writes = 0
            if sampled:
                for cells in self.cells.devices:
                    cells.reset_step()
            self.cells.host.clear()
            self.slot = slot + 1
            flags.step += 1
            upcoming = self.layout.sampled_at[self.slot]  # (re-read: nothing above changes it today)
            if upcoming is not flags._sampling:  # (the setter's call only where it changes)
                flags.sampling = upcoming
            flags.follow_cache_config()

    def _unwritten(self) -> np.ndarray:
        """[L] the layers whose eager forward check did not write its cell at this step."""
        step = self.flags.step
        return np.array([tap.checked_at != step for tap in self.cells.taps], dtype=bool) & self._checks_own

    def _report_tap_failure(self) -> None:
        self._hook_failures.collect(self.flags, self.cells.taps)

    def discard_pending(self) -> None:
        """Forget what the taps collected (no step() will claim it)."""
        for cells in self.cells.devices:
            cells.reset_window()
        if self.per_step_rows is not None:
            self.per_step_rows.forget()
        self.cells.host.clear()
        self.flags.forward_writes = 0
        self.flags.step += 1  # the taps' next calls are their first since the cells were zeroed

    def mark_window_failed(self) -> None:
        """Mark every step of the window as failed (a failure before the flush's collective)."""
        self._host[STEP_FAILED][:] = 1

    # ----------------------------------------------------------------- flush
    def prepare_flush(self) -> None:
        """Copy the host counts into the buffer, ready for the collective."""
        self._report_tap_failure()
        if self.per_step_rows is not None:
            self.per_step_rows.into_buffer(min(self.slot, self.flush_every))
        if self.layout.forward_aliases:
            self.layout.forward_aliases.fill_rows(self.buffer[FWD_SUM])
        self.buffer.load_host_states()

    def snapshot(self, steps: list[int], dead_eps: float, scaler_in_use: bool, layout: Layout | None = None) -> Window:
        """The window on the host, decoded from the (reduced) buffer: one device-to-host copy.

        ``layout``: the one whose buffer was reduced (a ``mesh.MeshLayout``), if not this rank's own.
        """
        layout = self.layout if layout is None else layout
        host = layout.buffer.to_host()
        return build_window(host, steps, layout, self.update_steps, dead_eps, scaler_in_use)

    def reset_window(self, after_step: bool = False) -> None:
        """Start an empty window (after a flush).

        ``after_step``: the flush came right after :meth:`record_step`, nothing run since (a full
        window, flushed by ``step()``): the taps' cells are as that step left them (zero, but for
        forward sums the per-step stage keeps, whose carry it takes out at the next step as within a
        window), so they are not zeroed again: four ops a window on a device. Else whatever the taps
        collected since is discarded."""
        self.buffer.zero_()
        if self.per_step_rows is not None:
            self.per_step_rows.start_window(keep_sums=after_step)
        if not after_step:
            self.discard_pending()
        self.update_rows.start_window()
        self.slot = 0
        self.layout.start_window()
        self.flags.sampling = True

    def follow_output_magnitudes(self, window: Any) -> None:
        """After a flush: reduce each layer's output statistics next window in float32 where this
        window's act_rms shows it exact there, and on the CPU its output-gradient statistics where
        its out_grad_norm does (``Cells.follow_output_magnitudes``). Not under a GradScaler: the
        taps see its scale, up to 2**24 above the window's unscaled norms."""
        act_rms = window.output_stats.get("act_rms") if window.output_stats else None
        by_name = {} if act_rms is None else {name: act_rms[:, i] for i, name in enumerate(window.layers)}
        grads = window.out_grad_norm
        grads_by_name = {} if self._scale_source is not None else {
            name: np.where(window.out_seen[:, i], grads[:, i], np.nan) for i, name in enumerate(window.layers)
        }  # fmt: skip
        self.cells.follow_output_magnitudes(by_name, grads_by_name)

    def suspect_dead_units(self, layers: np.ndarray) -> None:
        """Record in the window that this rank asked to confirm the dead units of ``layers`` (bool
        per layer): reduced with the window, so that every rank's rule backs off from the same record."""
        suspected = self._host[DEAD_SUSPECTED]
        suspected[np.asarray(layers, dtype=bool)] = 1

    def sample_rest_of_window(self, fresh: bool = False) -> None:
        """Record every statistic at every remaining step of this window, from the next one on.

        ``fresh``: forget the window's dead-unit evidence so far (a layer fell silent: what its units
        did before says nothing about now); device ops only, no sync.
        """
        if self.slot >= self.layout.flush_every:
            return
        if fresh:
            self._units_window.zero_()
            self.buffer[OUT_GRAD][: self.slot, 2].zero_()  # the samples behind that evidence
        self.layout.sample_from(self.slot)
        self.flags.sampling = True

    def replace_updates(self, updates: Any) -> None:
        """Measure update_ratio with ``updates`` (another optimizer's hooks) from now on; the old hooks are removed."""
        old, self.updates = self.updates, updates
        if old is not None:
            old.remove()

    def drop_references(self) -> None:
        """Forget the model (close()): the taps stop, the optimizer hooks go, the parameters are dropped."""
        self.replace_updates(None)
        self.flags.close()
        self.cells.release()
        self.flags.cache_configs = []
        self.discard_pending()
        self.param_stats.drop_references()


def _per_step_rows(layout: Layout, param_stats: ParamStats, layers: list[LayerSpec]) -> PerStepRows | None:
    """The per-step rows where they apply (``per_step_rows.py``): not where the per-step values are
    read from host memory (the CPU's own path), nor for the weighted columns of sharded tensors,
    nor for layers on several devices or on another than the buffer's (their forward sums are
    gathered by index). The cells group layers by their first parameter's device (``Cells``).
    Only where a copy to the host need not wait (CUDA's pinned memory, or CPU tensors): the stage
    goes to the host at every step, which on another device (MPS) would be a sync per step."""
    buffer = layout.buffer
    whole = bool(layers) and all(layer.params[0].device == buffer.device for layer in layers)
    if layout.host_path or param_stats.sharded or not whole or buffer.device.type not in ("cuda", "cpu"):
        return None
    return PerStepRows(buffer, layout.flush_every, param_stats.n_params, len(layout.names))


def _step_rows(buffer: Any, staged: PerStepRows | None, sampled: np.ndarray) -> list[StepRows]:
    """Each step's rows of the per-tensor states, made once (slicing is an op per call): max |g|
    only where ``sampled``; the sums of squares in the per-step stage where there is one
    (``staged``: the same tensor at every step), else in the buffer (on the CPU, with numpy views of them)."""
    flush_every = len(sampled)
    sq_rows = [staged.norms] * flush_every if staged is not None else [buffer.row(PARAM_SQ, t) for t in range(flush_every)]
    sq_host = None if staged is not None else buffer.host_view(PARAM_SQ)  # CPU buffers: numpy views made once
    return [
        StepRows(sq_rows[t], buffer.row(PARAM_MAX, t) if sampled[t] else None,
                 buffer.row(PARAM_NONFINITE, t), count=bool(sampled[t]),
                 sq_host=None if sq_host is None else sq_host[t], norms_allowed=staged is not None)
        for t in range(flush_every)
    ]  # fmt: skip
