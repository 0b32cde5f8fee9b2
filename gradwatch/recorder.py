"""Turns hook calls and gradients into on-device partial statistics, in states declared at attach.

Nothing here reads a device value back to the host between flushes: every op
is enqueued on the training device and written into the ``StatBuffer`` row of
the current step. The layout (which state, which shape, which reduction) is
fixed in ``Recorder.__init__`` from the layers, their parameters and their
declared units, so it is the same on every rank whatever each rank runs.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from .buffer import StatBuffer
from .devices import BoundedCache, IndexCache, host_to_device
from .layers import LayerSpec
from .param_stats import ParamStats, StepRows
from .window import Window

log = logging.getLogger("gradwatch")

# Per-step states: one row per step of the window.
PARAM_SQ = "param_sq"  # [F, P] per-tensor sum of squares of the parameter gradient
PARAM_MAX = "param_max"  # [F, P] per-tensor max |g|
PARAM_NONFINITE = "param_nonfinite"  # [F, P] per-tensor number of NaN/Inf elements
PARAM_PRESENT = "param_present"  # host [F, P] ranks on which the tensor had a gradient
OUT_SQ = "out_sq"  # [F, L] sum of squares of the output gradients, all calls
OUT_CALLS = "out_calls"  # host [F, L] output-gradient calls seen
FWD_SUM = "fwd_sum"  # [F, L] sum of the outputs: non-finite exactly when an output was
STEP_FAILED = "step_failed"  # host [F] ranks on which recording this step failed
# Window states.
UNIT_ACC = "unit_acc"  # [U] per unit: zero exactly for dead units
ROWS_SEEN = "rows_seen"  # host [L] output-gradient rows (samples x positions) judged for dead units
STEPS_SEEN = "steps_seen"  # host [L] steps whose output gradients were judged for dead units
# Update-to-weight ratio (with an optimizer): one row per measured optimizer step, at most
# flush_every + 1 per window (a measurement after a window's last step joins the next one).
UPDATE_SQ = "update_sq"  # [F + 1, P] ||w_after - w_before||^2 per tensor
WEIGHT_SQ = "weight_sq"  # [F + 1, P] ||w_before||^2 per tensor
UPDATE_SEEN = "update_seen"  # host [F + 1, P] ranks on which the tensor was measured

# Fold queued hook results into the buffer once this many are queued, so that
# forward/backward without step() cannot grow memory.
_MAX_PENDING_PER_LAYER = 16
_MAX_PENDING_FORWARD = 4096


class Recorder:
    """Collects one window of statistics for a fixed list of layers."""

    def __init__(
        self,
        layers: list[LayerSpec],
        flush_every: int,
        device: torch.device,
        scale_source: Callable[[], torch.Tensor | None],
        project_units: bool = True,
        world_size: int = 1,
        track_updates: bool = False,
        sample_every: int = 1,
    ) -> None:
        self.layers = layers
        self.names = [layer.name for layer in layers]
        self.flush_every = flush_every
        self.device = device
        self.active = True
        self.warned_compile = False
        # True: dead units by a random projection (exact zero test, dead_eps == 0);
        # False: per-unit L2 norms, compared with dead_eps > 0.
        self.project_units = project_units
        self._scale_source = scale_source
        n = len(layers)
        self.param_stats = ParamStats(layers, device, world_size)
        p = self.param_stats.n_params
        self.unit_count = np.array([layer.units for layer in layers], dtype=np.int64)
        self.unit_offset = np.concatenate([[0], np.cumsum(self.unit_count)[:-1]]).astype(np.int64)
        self.param_numel = np.zeros(n, dtype=np.int64)
        np.add.at(self.param_numel, self.param_stats.param_layer, self.param_stats.numel)

        buffer = self.buffer = StatBuffer(device)
        # Parameter gradients are identical on every data-parallel rank after
        # backward; sharded ones (DTensors) are partial sums and maxima, weighted so
        # that a world-wide sum counts each distinct piece once (see sharding.py).
        sharded = self.param_stats.sharded
        param_sum, param_max = ("sum", "max") if sharded else ("none", "none")
        F = flush_every
        buffer.add_state(PARAM_SQ, (F, p), param_sum)
        buffer.add_state(PARAM_MAX, (F, p), param_max)
        buffer.add_state(PARAM_NONFINITE, (F, p), param_sum)
        buffer.add_state(PARAM_PRESENT, (F, p), param_sum, host=True)
        # Output gradients and forward outputs differ per rank: combined by sum, like micro-batches.
        buffer.add_state(OUT_SQ, (F, n), "sum")
        buffer.add_state(OUT_CALLS, (F, n), "sum", host=True)
        buffer.add_state(FWD_SUM, (F, n), "sum")
        buffer.add_state(STEP_FAILED, (F,), "sum", host=True)
        buffer.add_state(UNIT_ACC, (int(self.unit_count.sum()),), "sum")
        buffer.add_state(ROWS_SEEN, (n,), "sum", host=True)
        # Distinct steps: every rank samples the same steps, so the most any rank saw (a lower
        # bound of the union when a layer runs on some ranks only).
        buffer.add_state(STEPS_SEEN, (n,), "max", host=True)
        self.track_updates = track_updates
        if track_updates:
            buffer.add_state(UPDATE_SQ, (F + 1, p), param_sum)
            buffer.add_state(WEIGHT_SQ, (F + 1, p), param_sum)
            buffer.add_state(UPDATE_SEEN, (F + 1, p), param_sum, host=True)
        buffer.freeze()
        self._dtype = buffer.dtype
        self._host = buffer.host

        self.slot = 0
        # Sampled steps record every statistic; the others (detail="standard") record the
        # per-tensor sums of squares and the forward check only. Slots 0 and 1 of every window
        # are sampled, then every sample_every-th: every window has output-gradient statistics,
        # and dead units are judged on at least two distinct steps at the window's own flush.
        self.sample_every = max(1, int(sample_every))
        self.sampled_slots = (np.arange(F) % self.sample_every == 0) | (np.arange(F) == 1)
        self.sampling = True  # whether the current step is a sampled one
        self.update_steps: list[int] = []  # the optimizer step each update row describes
        self._update_weights: torch.Tensor | None = None  # per-column weights when sharded
        self.forward_order: list[int] = []
        self.backward_order: list[int] = []
        self._backward_seen: set[int] = set()
        # (forward order, backward order) of each step of the window, for naming
        # the origin of non-finite values.
        self.step_orders: list[tuple[list[int], list[int]]] = []
        # The forward sums of the window, with their flat positions (slot * layers + layer) in
        # FWD_SUM: reduced into the buffer once per window (or every _MAX_PENDING_FORWARD).
        self._fwd_sums: list[torch.Tensor] = []
        self._fwd_pos: list[int] = []
        self._fwd_base = 0  # slot * layers of the current step
        self._pending_layer: list[int] = []  # the layer of each queued output-gradient call
        self._sq = _CallSums(device, _MAX_PENDING_PER_LAYER * n + 1)
        self._units: list[torch.Tensor] = []  # per-unit dead-test vectors
        self._units_layer: list[int] = []
        self._weights = _ProjectionWeights()
        # key: the layer of each queued call, in order
        self._call_layers = IndexCache(device)  # -> that layer index per call
        self._fwd_index = IndexCache(device, limit=8)  # a window's forward positions -> index tensor
        self._call_units = IndexCache(device)  # -> the buffer offsets of each call's units
        self._call_counts = BoundedCache()  # -> calls per layer (np.add.at costs ~70 us a call)
        self._grad_hooks: dict[tuple[int, int, int], Callable] = {}
        self._judged_this_step: set[int] = set()  # layers with dead-unit evidence in the current step
        self._failures: set[str] = set()
        self._mismatch_logged: set[int] = set()
        # Unsampled steps leave max |g| (and, on accelerators, the non-finite count) out.
        sq_host = buffer.host_view(PARAM_SQ)  # CPU buffers: numpy views made once
        self._param_rows = [
            StepRows(buffer.row(PARAM_SQ, t), buffer.row(PARAM_MAX, t) if self.sampled_slots[t] else None,
                     buffer.row(PARAM_NONFINITE, t), count=bool(self.sampled_slots[t]),
                     sq_host=None if sq_host is None else sq_host[t])
            for t in range(F)
        ]  # fmt: skip

    # ----------------------------------------------------------------- hooks
    def on_forward(self, index: int, out: torch.Tensor, extra: bool = False) -> None:
        """Called by the forward hook of layer ``index`` with its output.

        ``extra``: a further tensor of a structured output (an RNN's h_n); it is
        monitored only if it has the layer's declared units, else ignored.
        """
        layer = self.layers[index]
        if extra:
            units = layer.units
            if out.ndim == 0 or units == 0 or out.shape[layer.unit_dim(out.ndim)] != units:
                return
        # sum(out) is non-finite exactly when the output holds a NaN/Inf (or overflows
        # float32, which is as alarming); fold() reduces the queued sums in one go. Grad mode
        # off instead of detach(): one op per call fewer, and no autograd node.
        set_grad = torch._C._set_grad_enabled
        set_grad(False)
        try:
            total = out.sum(dtype=torch.float32)
        finally:
            set_grad(True)
        if total.device != self.device:  # a model spread over several devices
            total = total.to(self.device, non_blocking=True)
        self._fwd_sums.append(total)
        self._fwd_pos.append(self._fwd_base + index)
        if len(self._fwd_sums) >= _MAX_PENDING_FORWARD:
            self._fold_forward()
        if not extra and len(self.forward_order) < 4 * len(self.layers):
            self.forward_order.append(index)
        if out.requires_grad and self.sampling:  # unsampled steps register no tensor hook at all
            units = int(out.shape[layer.unit_dim(out.ndim)]) if out.ndim else 1
            hook = self._grad_hooks.get((index, out.ndim, units))
            if hook is None:
                hook = self._make_grad_hook(index, out.ndim, units)
            out.register_hook(hook)

    def _make_grad_hook(self, index: int, ndim: int, units: int) -> Callable:
        layer = self.layers[index]
        unit_dim = layer.unit_dim(ndim)
        per_unit = layer.units > 0 and units == layer.units and ndim > 0
        if layer.units > 0 and not per_unit and index not in self._mismatch_logged:
            self._mismatch_logged.add(index)
            log.info(
                "gradwatch: layer %s produced an output with %d units in dim %d, not the %d its "
                "parameters declare; its dead units are not judged for such calls",
                layer.name, units, unit_dim, layer.units,
            )  # fmt: skip
        reduce = _output_grad_reducer(
            ndim, unit_dim, units, self.project_units, self._weights, per_unit, self._dtype
        )
        pending_layer, units_list, units_layer = self._pending_layer, self._units, self._units_layer
        judged_this_step = self._judged_this_step
        call_sums = self._sq
        rows_seen = self._host[ROWS_SEEN]
        limit = _MAX_PENDING_PER_LAYER * len(self.layers)
        device = self.device

        def grad_hook(grad: torch.Tensor) -> None:
            # Every op here runs once per layer call, right after a backward GEMM has
            # evicted the interpreter's working set: keep it to the two reductions.
            try:
                norm, vector = reduce(grad, call_sums.slot(grad))
                call_sums.add(grad, norm)
                pending_layer.append(index)
                if vector is not None:
                    if vector.device != device:  # a model spread over several devices
                        vector = vector.to(device, non_blocking=True)
                    units_list.append(vector)
                    units_layer.append(index)
                    rows_seen[index] += grad.numel() // units
                    judged_this_step.add(index)
                if len(pending_layer) >= limit:
                    self.fold()
            except Exception as exc:
                self.hook_failed(layer.name, exc)

        self._grad_hooks[(index, ndim, units)] = grad_hook
        return grad_hook

    def hook_failed(self, where: str, exc: BaseException) -> None:
        """A hook raised: warn once per layer and kind of error, and keep training going."""
        key = f"{where}:{type(exc).__name__}"
        if key not in self._failures:
            self._failures.add(key)
            log.warning(
                "gradwatch: internal error in the hook of layer %s (%s: %s); "
                "its statistics may be incomplete, training continues",
                where,
                type(exc).__name__,
                exc,
            )

    # ------------------------------------------------------------------ step
    def _fold_forward(self) -> None:
        """Add the queued forward sums into FWD_SUM: three ops for a window's worth of calls."""
        if not self._fwd_sums:
            return
        # Each cell accumulates the sums of a layer's outputs in a step: it is non-finite exactly
        # where some call produced a NaN/Inf; read as such on the host at flush.
        index = self._fwd_index.get(tuple(self._fwd_pos))
        sums = torch.stack(self._fwd_sums).to(self._dtype)
        self.buffer[FWD_SUM].view(-1).index_add_(0, index, sums)
        self._fwd_sums.clear()
        self._fwd_pos.clear()

    def fold(self) -> None:
        """Reduce the queued output-gradient partials into the current step's row."""
        if not self._pending_layer:
            return
        slot = self.slot
        layers_of = self._pending_layer
        key = tuple(layers_of)
        n_layers = len(self.layers)
        self._host[OUT_CALLS][slot] += self._call_counts.get(
            key, lambda: np.bincount(np.asarray(key, dtype=np.int64), minlength=n_layers)
        )
        seen = self._backward_seen
        for i in layers_of:
            if i not in seen:
                seen.add(i)
                self.backward_order.append(i)
        squares = self._sq.take(len(layers_of), self._dtype)
        scale = self._scale_source()
        if scale is not None:
            squares.div_(scale.to(self._dtype).square())
        self.buffer.row(OUT_SQ, slot).index_add_(0, self._call_layers.get(key), squares)
        layers_of.clear()
        if self._units:
            unit_key = tuple(self._units_layer)
            unit_idx = self._call_units.get(unit_key, lambda: self._unit_positions(unit_key))
            vectors = torch.cat(self._units).to(self._dtype)
            if self.project_units:
                vectors.abs_()  # the projections of separate calls must not cancel each other out
            elif scale is not None:
                # per-unit sums of squares are compared with dead_eps: unscale them first
                vectors.div_(scale.to(self._dtype).square())
            self.buffer[UNIT_ACC].index_add_(0, unit_idx, vectors)
            self._units.clear()
            self._units_layer.clear()

    def _unit_positions(self, key: tuple[int, ...]) -> np.ndarray:
        return np.concatenate([np.arange(self.unit_offset[i], self.unit_offset[i] + self.unit_count[i]) for i in key])

    def record_step(self, params_scaled: bool = False) -> None:
        """Write this step's statistics into the current row and advance; no host sync.

        ``params_scaled``: the parameter gradients still carry the loss scale
        (an optimizer that unscales inside its own step, e.g. fused Adam).
        The row advances even when recording fails, so that every rank flushes
        at the same step; a failed row is marked and left out of the window.
        """
        slot = self.slot
        try:
            self.fold()
            rows = self._param_rows[slot]
            self.param_stats.record(rows, self._host[PARAM_PRESENT][slot])
            if params_scaled:
                scale = self._scale_source()
                if scale is not None:
                    scale = scale.to(self._dtype)
                    rows.sq.div_(scale.square())
                    if rows.max is not None:
                        rows.max.div_(scale)
        except Exception:
            self._host[STEP_FAILED][slot] = 1
            raise
        finally:
            self.step_orders.append((self.forward_order, self.backward_order))  # deduplicated at flush
            if self._judged_this_step:
                self._host[STEPS_SEEN][list(self._judged_this_step)] += 1
                self._judged_this_step.clear()
            self.forward_order = []
            self.backward_order = []
            self._backward_seen = set()
            self.discard_pending(keep_forward=True)
            self.slot = slot + 1
            self._fwd_base = self.slot * len(self.names)
            self.sampling = bool(self.sampled_slots[self.slot]) if self.slot < self.flush_every else True

    def write_update(
        self, step: int, columns: np.ndarray, index: torch.Tensor, update_sq: torch.Tensor, weight_sq: torch.Tensor
    ) -> None:
        """Record one measured optimizer step's squared norms for ``columns`` (``index``: the same on the device)."""
        row = len(self.update_steps)
        if row > self.flush_every:  # no flush since: measurements beyond a window's capacity are dropped
            return
        dtype = self._dtype
        update, weight = update_sq.to(dtype), weight_sq.to(dtype)
        if self.param_stats.sharded:
            if self._update_weights is None:
                self._update_weights = host_to_device(self.param_stats.param_weights(), self.device, dtype)
            scale = self._update_weights.index_select(0, index)
            update, weight = update * scale, weight * scale
        self.buffer.row(UPDATE_SQ, row).index_copy_(0, index, update)
        self.buffer.row(WEIGHT_SQ, row).index_copy_(0, index, weight)
        self._host[UPDATE_SEEN][row][columns] = 1
        self.update_steps.append(step)

    def mark_window_failed(self) -> None:
        """Mark every step of the window as failed (a failure before the flush's collective)."""
        self._host[STEP_FAILED][:] = 1

    # ----------------------------------------------------------------- flush
    def prepare_flush(self) -> None:
        """Fold what is queued and copy the host counts into the buffer, ready for the collective."""
        self.fold()
        self._fold_forward()
        self.buffer.load_host_states()

    def snapshot(self, steps: list[int], dead_eps: float, scaler_in_use: bool) -> Window:
        """The window on the host, decoded from the (reduced) buffer: one device-to-host copy."""
        host = self.buffer.to_host()
        return build_window(host, steps, self, dead_eps, scaler_in_use)

    def reset_window(self) -> None:
        """Start an empty window (after a flush)."""
        self.buffer.zero_()
        self.step_orders = []
        self.update_steps = []
        self.slot = 0
        self._fwd_base = 0
        self.sampling = True

    def discard_pending(self, keep_forward: bool = False) -> None:
        """Forget hook results that no step() will claim (``keep_forward``: the window's forward sums stay)."""
        self._pending_layer.clear()
        self._sq.clear()
        self._units.clear()
        self._units_layer.clear()
        if not keep_forward:
            self._fwd_sums.clear()
            self._fwd_pos.clear()

    def drop_references(self) -> None:
        """Forget the model (close()): modules, parameters and the hooks that hold them."""
        self.active = False
        self.discard_pending()
        self._grad_hooks.clear()
        self.layers = []
        self.param_stats.drop_references()


def build_window(host: dict[str, np.ndarray], steps: list[int], rec: Recorder, dead_eps: float,
                 scaler_in_use: bool) -> Window:  # fmt: skip
    """Decode the host copy of the buffer into a per-layer ``Window``."""
    n = len(steps)
    ps = rec.param_stats
    n_layers = len(rec.names)
    ok = host[STEP_FAILED][:n] == 0
    present = host[PARAM_PRESENT][:n] > 0
    owner = ps.param_layer

    def per_layer(values: np.ndarray, how: str = "sum") -> np.ndarray:
        """[rows, tensor] -> [rows, layer]: the sum (or maximum) over each layer's tensors."""
        rows = values.shape[0]
        out = np.zeros((rows, n_layers)) if how == "sum" else np.full((rows, n_layers), -np.inf)
        if how == "sum":
            np.add.at(out.T, owner, values.T)
        else:
            np.maximum.at(out.T, owner, values.T)
        return out

    with np.errstate(invalid="ignore"):
        sq_t = np.where(present, host[PARAM_SQ][:n], 0.0)
        has_grad = (per_layer(present.astype(np.float64), "sum") > 0) & ok[:, None]
        sumsq = per_layer(sq_t, "sum")
        grad_norm = np.where(has_grad, np.sqrt(sumsq), np.nan)
        sampled = rec.sampled_slots[:n]
        max_t = np.where(present, host[PARAM_MAX][:n], -np.inf)
        grad_max = np.where(has_grad & sampled[:, None], per_layer(max_t, "max"), np.nan)
        counts = np.rint(np.where(present, host[PARAM_NONFINITE][:n], 0.0))
        nonfinite = np.where(has_grad, per_layer(counts, "sum"), 0.0)
        # Non-finite counts are exact on the CPU at every step (a host check of the sums);
        # on accelerators they are taken on sampled steps, the others know "finite or not".
        counted = sampled | (rec.device.type == "cpu")
        seen_out = (host[OUT_CALLS][:n] > 0) & ok[:, None]
        out_grad_norm = np.where(seen_out, np.sqrt(host[OUT_SQ][:n]), np.nan)
        global_norm = np.sqrt(np.where(has_grad, sumsq, 0.0).sum(axis=1))
        global_norm = np.where(has_grad.any(axis=1), global_norm, np.nan)
    fwd_nonfinite = ~np.isfinite(host[FWD_SUM][:n]) & ok[:, None]

    units = host[UNIT_ACC]
    dead = np.full(n_layers, np.nan)
    rows_seen = host[ROWS_SEEN].astype(np.int64)
    unit_alive: list[np.ndarray | None] = [None] * n_layers
    for i in range(n_layers):
        count = rec.unit_count[i]
        if count == 0 or rows_seen[i] == 0:
            continue
        offset = rec.unit_offset[i]
        # Per unit: a non-negative accumulator that is zero exactly when the unit's
        # output gradient was zero for every sample (its L2 norm when dead_eps > 0).
        unit_value = np.sqrt(np.abs(units[offset : offset + count]))
        unit_alive[i] = ~(unit_value <= dead_eps)  # NaN (non-finite) is not dead
        dead[i] = 1.0 - float(np.mean(unit_alive[i]))

    update_steps: list[int] = []
    update_ratio = judged_ratio = weight_rms = None
    if rec.track_updates and rec.update_steps:
        u = len(rec.update_steps)
        update_steps = list(rec.update_steps)
        seen = host[UPDATE_SEEN][:u] > 0
        upd = np.where(seen, host[UPDATE_SQ][:u], 0.0)
        wsq = np.where(seen, host[WEIGHT_SQ][:u], 0.0)
        judged = seen & (ps.ndim >= 2)[None, :]  # weight matrices and kernels (not norms, biases, scales)

        def layer_sum(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
            return per_layer(np.where(mask, values, 0.0))

        measured = layer_sum(seen.astype(np.float64), seen) > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            update_ratio = np.where(measured, np.sqrt(layer_sum(upd, seen) / layer_sum(wsq, seen)), np.nan)
            weights_sq, weights_n = layer_sum(wsq, judged), layer_sum(np.broadcast_to(ps.numel, wsq.shape).astype(np.float64), judged)
            judged_ratio = np.sqrt(layer_sum(upd, judged) / weights_sq)
            weight_rms = np.sqrt(weights_sq / weights_n)
        judged_ratio = np.where(layer_sum(judged.astype(np.float64), judged) > 0, judged_ratio, np.nan)

    skipped = None
    if scaler_in_use:
        # GradScaler skips exactly the steps whose gradients hold an Inf/NaN.
        skipped = ((nonfinite.sum(axis=1) > 0) | (~np.isfinite(global_norm) & has_grad.any(axis=1))) & ok
    return Window(
        steps=list(steps),
        layers=list(rec.names),
        grad_norm=grad_norm,
        grad_max=grad_max,
        nonfinite=nonfinite,
        out_grad_norm=out_grad_norm,
        fwd_nonfinite=fwd_nonfinite,
        has_grad=has_grad,
        out_seen=seen_out,
        unit_counts=rec.unit_count.copy(),
        param_numel=rec.param_numel.copy(),
        dead_fraction=dead,
        global_grad_norm=global_norm,
        step_orders=[(_first_seen(fwd), bwd) for fwd, bwd in rec.step_orders[:n]],
        skipped=skipped,
        rows_seen=rows_seen,
        steps_judged=host[STEPS_SEEN].astype(np.int64),
        unit_alive=unit_alive,
        sampled=sampled.copy(),
        nonfinite_counted=counted.copy(),
        update_steps=update_steps,
        update_ratio=update_ratio,
        judged_update_ratio=judged_ratio,
        judged_weight_rms=weight_rms,
    )


def _first_seen(order: list[int]) -> list[int]:
    seen: set[int] = set()
    return [i for i in order if not (i in seen or seen.add(i))]


class _CallSums:
    """Where the output-gradient hooks put each call's sum of squares, in call order.

    CPU buffer: each call writes a float32 slot of one preallocated tensor whose
    memory numpy shares; the hook checks its slot on the host (a plain memory
    read) and, for a finite gradient whose squares overflowed float32, keeps the
    float64 sum aside. Accelerator buffer: each call's norm is computed in
    float64 (no more than the memory read costs there) and squared at fold.
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.cpu = device.type == "cpu"
        self.device = device
        self._slots = torch.zeros(capacity if self.cpu else 0, dtype=torch.float32)
        self._host = self._slots.numpy()
        self._views = list(self._slots.unbind())
        self._norms: list[torch.Tensor] = []
        self._exact: dict[int, torch.Tensor] = {}
        self._heads: dict[int, torch.Tensor] = {}
        self.count = 0
        self.warned_device = False

    def slot(self, grad: torch.Tensor) -> torch.Tensor | None:
        """The 0-d float32 slot for this call (CPU buffer, CPU gradient), else None."""
        if self.cpu and grad.device.type == "cpu":
            return self._views[self.count]
        return None

    def add(self, grad: torch.Tensor, norm: torch.Tensor | None) -> None:
        """Account for the call just reduced: ``norm`` is its float64 norm when it had no slot."""
        if norm is None:
            if not np.isfinite(self._host[self.count]):
                exact = torch.linalg.vector_norm(grad.detach().reshape(-1), dtype=torch.float64)
                self._exact[self.count] = exact.square()
        elif self.cpu:  # a gradient on another device than the buffer (attached before .to(device))
            if not self.warned_device:
                self.warned_device = True
                log.warning(
                    "gradwatch: the monitor's buffer is on the CPU but a layer's gradients are on %s, "
                    "which costs a host sync per call; create the monitor after moving the model "
                    "to its device", grad.device,
                )  # fmt: skip
            self._views[self.count].zero_()
            self._exact[self.count] = norm.to("cpu", torch.float64).square()
        else:
            self._norms.append(norm if norm.device == self.device else norm.to(self.device, non_blocking=True))
        self.count += 1

    def take(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        """The ``k`` queued sums of squares as one tensor of ``dtype``; empties the queue."""
        if not self.cpu:
            squares = torch.stack(self._norms).to(dtype).square_()
        else:
            head = self._heads.get(k)
            if head is None:
                head = self._heads[k] = self._slots[:k]
            squares = head.to(dtype, copy=True)
            for i, exact in self._exact.items():
                squares[i] = exact.to(dtype)
        self.clear()
        return squares

    def clear(self) -> None:
        self._norms.clear()
        self._exact.clear()
        self.count = 0


Reducer = Callable[[torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor | None, torch.Tensor | None]"]


def _output_grad_reducer(
    ndim: int, unit_dim: int, units: int, project: bool, weights: "_ProjectionWeights", per_unit: bool, acc: torch.dtype
) -> Reducer:
    """``reduce(grad, slot) -> (norm, per_unit_vector)`` for one layer's output gradients.

    The sum of squares goes into ``slot`` (a 0-d float32 CPU tensor) when one is
    given, and ``norm`` is None; without a slot, ``norm`` is the gradient's norm
    accumulated in ``acc`` (float64). The per-unit vector (None when the layer's
    units are not judged) is zero exactly for the units whose gradient is zero
    for every sample. Every variant reads the gradient in single contiguous
    passes without a gradient-sized temporary where it can: a strided reduction
    over the batch dim is ~5-25x slower on the CPU, and ``(g * g).sum(0)``
    allocates and writes a copy of the gradient first.
    """
    f32 = torch.float32
    norm = torch.linalg.vector_norm
    other_dims = tuple(d for d in range(ndim) if d != unit_dim)

    def general(g: torch.Tensor, slot: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # Any strides and dtypes; per-unit sums of squares.
        g = g.detach()
        if g.dtype != f32:
            g = g.to(f32)  # fp16 squares overflow; accumulate in fp32
        squares = g * g
        vector = (squares.sum(other_dims) if other_dims else squares).reshape(-1) if per_unit else None
        if slot is None:
            return norm(g, dtype=acc), vector
        torch.sum(vector if vector is not None else squares.reshape(-1), 0, out=slot)
        return None, vector

    if not per_unit:

        def total_only(g: torch.Tensor, slot: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if slot is None or not g.is_contiguous():
                return _norm_or_slot(g, slot, acc), None
            if g.requires_grad:
                g = g.detach()
            flat = (g if g.dtype == f32 else g.to(f32)).view(-1)
            torch.dot(flat, flat, out=slot)
            return None, None

        return total_only

    if ndim <= 1:
        return general

    if unit_dim == 1 and ndim >= 3:  # (N, C, *spatial): one norm per (sample, channel) row

        def channels(g: torch.Tensor, slot: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if not g.is_contiguous():
                return general(g, slot)
            n = g.shape[0]
            rows = norm(g.detach().reshape(n * units, -1), 2, 1, dtype=f32)
            if slot is None:
                total = norm(rows, dtype=acc)
                return total, rows.view(n, units).square_().sum(0)
            vector = rows.view(n, units).square_().sum(0)
            torch.sum(vector, 0, out=slot)
            return None, vector

        return channels

    if not project:
        return general

    dot, mv = torch.dot, torch.mv
    cached: list = [None, None]  # the row count and the weights last used (a layer keeps its device)

    def last(g: torch.Tensor, slot: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # (*, U): the sum of squares by one BLAS dot; the dead-unit test by one
        # matrix-vector product with fixed random positive weights: sum_m r_m g[m, u]
        # is 0 when the unit's gradient is 0 for every sample, and (but for an exact
        # floating-point cancellation against random weights) not otherwise. The
        # caller takes the absolute value once for all calls (Recorder.fold).
        if not g.is_contiguous():
            return general(g, slot)
        if g.requires_grad:  # only with backward(create_graph=True)
            g = g.detach()
        if g.dtype != f32:
            g = g.to(f32)  # fp16 squares overflow; accumulate in fp32
        rows = g if ndim == 2 else g.view(-1, units)  # (batch, units): no view op needed
        n = rows.shape[0]
        if n != cached[0]:
            cached[0], cached[1] = n, weights.get(n, rows.device)
        flat = g.view(-1)
        if slot is None:
            return norm(flat, dtype=acc), mv(rows.t(), cached[1])
        dot(flat, flat, out=slot)
        return None, mv(rows.t(), cached[1])

    return last


def _norm_or_slot(g: torch.Tensor, slot: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor | None:
    g = g.detach()
    if slot is None:
        return torch.linalg.vector_norm(g, dtype=acc)
    flat = g.to(torch.float32).reshape(-1)
    torch.dot(flat, flat, out=slot)
    return None


class _ProjectionWeights:
    """Fixed random weights in [1, 2) per (length, device), for the dead-unit projection."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._generators: dict[torch.device, torch.Generator] = {}

    def get(self, length: int, device: torch.device) -> torch.Tensor:
        key = (length, device)
        weights = self._cache.get(key)
        if weights is None:
            # Drawn on the device itself: no host-to-device copy, whatever the batch size.
            generator = self._generators.get(device)
            if generator is None:
                try:
                    generator = torch.Generator(device=device).manual_seed(20261129)
                except RuntimeError:  # a backend without its own generators
                    generator = torch.Generator().manual_seed(20261129)
                self._generators[device] = generator
            if generator.device == device or generator.device.type == device.type:
                weights = torch.rand(length, generator=generator, device=device).add_(1.0)
            else:
                weights = torch.rand(length, generator=generator).add_(1.0).to(device)
            if len(self._cache) < 32:
                self._cache[key] = weights
        return weights
