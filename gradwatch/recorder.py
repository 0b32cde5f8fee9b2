"""Turns hook calls and gradients into on-device partial statistics.

Nothing here reads a value back to the host: every op is enqueued on the
training device and written into the ``StatBuffer`` row of the current step.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from .buffer import StatBuffer
from .devices import BoundedCache, IndexCache
from .layers import LayerSpec
from .param_stats import ParamStats

log = logging.getLogger("gradwatch")

# Step-level states, one row per step of the window ([flush_every, layers]).
PARAM_SUMSQ = "param_sumsq"
PARAM_MAX = "param_max"
PARAM_NONFINITE = "param_nonfinite"
OUT_SUMSQ = "out_sumsq"
FWD_NONFINITE = "fwd_nonfinite"
UNIT_SUMSQ = "unit_sumsq"  # per unit, over the window: zero exactly for dead units

# Fold pending output-gradient norms into the buffer once this many are queued,
# so that forward/backward without step() cannot grow memory.
_MAX_PENDING_PER_LAYER = 16


class Recorder:
    """Collects one window of statistics for a fixed list of layers."""

    def __init__(
        self,
        layers: list[LayerSpec],
        flush_every: int,
        device: torch.device,
        scale_source: Callable[[], torch.Tensor | None],
        project_units: bool = True,
    ) -> None:
        self.layers = layers
        self.flush_every = flush_every
        self.device = device
        self.active = True
        self.warned_compile = False
        # True: dead units by a random projection (exact zero test, dead_eps == 0);
        # False: per-unit L2 norms, compared with dead_eps > 0.
        self.project_units = project_units
        self._scale_source = scale_source
        n = len(layers)
        self.buffer = StatBuffer(device)
        self.param_stats = ParamStats(layers, device)
        # Parameter gradients are identical on every data-parallel rank after
        # backward; sharded ones (FSDP2 DTensors) are partial sums and maxima.
        param_reduce = "sum" if self.param_stats.sharded else "none"
        max_reduce = "max" if self.param_stats.sharded else "none"
        self.buffer.add_state(PARAM_SUMSQ, (flush_every, n), param_reduce)  # type: ignore[arg-type]
        self.buffer.add_state(PARAM_MAX, (flush_every, n), max_reduce)  # type: ignore[arg-type]
        self.buffer.add_state(PARAM_NONFINITE, (flush_every, n), param_reduce)  # type: ignore[arg-type]
        # Output gradients differ per rank: combined by sum like micro-batches.
        self.buffer.add_state(OUT_SUMSQ, (flush_every, n), "sum")
        self.buffer.add_state(FWD_NONFINITE, (flush_every, n), "sum")
        self.buffer.add_state(UNIT_SUMSQ, (0,), "sum")

        self.slot = 0
        # Host-side facts known without reading the device.
        self.out_calls = np.zeros((flush_every, n), dtype=np.int64)
        self.param_present = np.zeros((flush_every, n), dtype=np.int64)
        self.forward_order: list[int] = []
        self.backward_order: list[int] = []
        self._backward_seen: set[int] = set()
        # (forward order, backward order) of each step of the window, for naming
        # the origin of non-finite values.
        self.step_orders: list[tuple[list[int], list[int]]] = []
        self.unit_offset: list[int | None] = [None] * n
        self.unit_count: list[int] = [0] * n
        self._fwd_sums: list[torch.Tensor] = []
        self._fwd_layer: list[int] = []
        self._pending: list[torch.Tensor] = []  # per-unit dead-test vectors
        self._pending_sq: list[torch.Tensor] = []  # sums of squares
        self._pending_layer: list[int] = []
        self._weights = _ProjectionWeights()
        # key: the layer of each queued call, in order
        self._call_layers = IndexCache(device)  # -> that layer index per call
        self._call_units = IndexCache(device)  # -> the buffer offsets of each call's units
        self._call_counts = BoundedCache()  # -> calls per layer (np.add.at costs ~70 us a call)
        self._grad_hooks: dict[tuple[int, int], Callable] = {}
        self._failures: set[str] = set()

    # ----------------------------------------------------------------- hooks
    def on_forward(self, index: int, out: torch.Tensor, extra: bool = False) -> None:
        """Called by the forward hook of layer ``index`` with its output.

        ``extra``: a further tensor of a structured output (an RNN's h_n); it is
        monitored only if it has the layer's units, else ignored.
        """
        if extra:
            units = self.unit_count[index]
            if out.ndim == 0 or units == 0 or out.shape[self.layers[index].unit_dim(out.ndim)] != units:
                return
        # sum(out) is non-finite exactly when the output holds a NaN/Inf (or overflows
        # float32, which is as alarming); fold() reduces the queued sums in one go.
        total = out.detach().sum(dtype=torch.float32)
        if total.device != self.device:  # a model spread over several devices
            total = total.to(self.device, non_blocking=True)
        self._fwd_sums.append(total)
        self._fwd_layer.append(index)
        if len(self._fwd_sums) > _MAX_PENDING_PER_LAYER * len(self.layers):
            self.fold()
        if not extra and len(self.forward_order) < 4 * len(self.layers):
            self.forward_order.append(index)
        if out.requires_grad:
            hook = self._grad_hooks.get((index, out.ndim))
            if hook is None:
                hook = self._make_grad_hook(index, out)
            out.register_hook(hook)

    def _make_grad_hook(self, index: int, out: torch.Tensor) -> Callable:
        layer = self.layers[index]
        ndim = out.ndim
        unit_dim = layer.unit_dim(ndim)
        units = int(out.shape[unit_dim]) if ndim else 1
        if self.unit_offset[index] is None:
            self._add_units(index, units)
        elif self.unit_count[index] != units:
            raise RuntimeError(
                f"layer {layer.name} produced outputs with {units} and {self.unit_count[index]} units"
            )
        pending_sq, pending_units, pending_layer = self._pending_sq, self._pending, self._pending_layer
        limit = _MAX_PENDING_PER_LAYER * len(self.layers)
        reduce = _output_grad_reducer(ndim, unit_dim, units, self.project_units, self._weights)

        device = self.device

        def grad_hook(grad: torch.Tensor) -> None:
            # Every op here runs once per layer call, right after a backward GEMM has
            # evicted the interpreter's working set: keep it to the two reductions.
            try:
                sumsq, per_unit = reduce(grad)
                if sumsq.device != device:  # a model spread over several devices
                    sumsq = sumsq.to(device, non_blocking=True)
                    per_unit = per_unit.to(device, non_blocking=True)
                pending_sq.append(sumsq)
                pending_units.append(per_unit)
                pending_layer.append(index)
                if len(pending_layer) > limit:
                    self.fold()
            except Exception as exc:
                self.hook_failed(layer.name, exc)

        self._grad_hooks[(index, ndim)] = grad_hook
        return grad_hook

    def _add_units(self, index: int, units: int) -> None:
        total = self.buffer[UNIT_SUMSQ].numel()
        self.unit_offset[index] = total
        self.unit_count[index] = units
        self.buffer.add_state(UNIT_SUMSQ, (total + units,), "sum")

    def hook_failed(self, where: str, exc: BaseException) -> None:
        """A hook raised: warn once per layer and keep training going."""
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
    def fold(self) -> None:
        """Reduce the queued forward sums and output-gradient partials into the current step's row."""
        if self._fwd_sums:
            index = self._call_layers.get(tuple(self._fwd_layer))
            # The row accumulates the sums of the outputs: it is non-finite exactly where
            # some call of the layer produced a NaN/Inf (or sums beyond float32, as alarming);
            # read as such on the host at flush.
            self.buffer.row(FWD_NONFINITE, self.slot).index_add_(0, index, torch.stack(self._fwd_sums))
            self._fwd_sums.clear()
            self._fwd_layer.clear()
        if not self._pending:
            return
        pending, layers_of = self._pending, self._pending_layer
        key = tuple(layers_of)
        n_layers = len(self.layers)
        self.out_calls[self.slot] += self._call_counts.get(
            key, lambda: np.bincount(np.asarray(key, dtype=np.int64), minlength=n_layers)
        )
        seen = self._backward_seen
        for i in layers_of:
            if i not in seen:
                seen.add(i)
                self.backward_order.append(i)
        call_layer_idx = self._call_layers.get(key)
        unit_idx = self._call_units.get(key, lambda: self._unit_positions(key))
        squares = torch.stack(self._pending_sq)
        scale = self._scale_source()
        if scale is not None:
            # The per-unit vectors only answer "zero or not": the scale does not matter there.
            squares.div_(scale.to(squares.dtype).square())
        # abs: the projections of separate calls must not cancel each other out
        self.buffer[UNIT_SUMSQ].index_add_(0, unit_idx, torch.cat(pending).abs_())
        self.buffer.row(OUT_SUMSQ, self.slot).index_add_(0, call_layer_idx, squares)
        pending.clear()
        self._pending_sq.clear()
        layers_of.clear()

    def _unit_positions(self, key: tuple[int, ...]) -> np.ndarray:
        positions = []
        for layer in key:
            offset = self.unit_offset[layer]
            assert offset is not None
            positions.append(np.arange(offset, offset + self.unit_count[layer]))
        return np.concatenate(positions)

    def record_step(self, params_scaled: bool = False) -> None:
        """Write this step's statistics into the current row; no host sync.

        ``params_scaled``: the parameter gradients still carry the loss scale
        (an optimizer that unscales inside its own step, e.g. fused Adam).
        """
        self.fold()
        row = self.slot
        sumsq_row, max_row = self.buffer.row(PARAM_SUMSQ, row), self.buffer.row(PARAM_MAX, row)
        present = self.param_stats.record(sumsq_row, max_row, self.buffer.row(PARAM_NONFINITE, row))
        scale = self._scale_source() if params_scaled else None
        if scale is not None:
            scale = scale.to(torch.float32)
            sumsq_row.div_(scale.square())
            max_row.div_(scale)
        self.param_present[row] = present
        # The forward row is read as "non-finite or not" on the host at flush
        # (window.build_window): no per-step op here.
        self.step_orders.append((_first_seen(self.forward_order), self.backward_order))
        self.forward_order = []
        self.backward_order = []
        self._backward_seen = set()
        self.slot += 1

    def reset_window(self) -> None:
        """Start an empty window (after a flush)."""
        self.buffer.zero_()
        self.out_calls[:] = 0
        self.param_present[:] = 0
        self.step_orders = []
        self.slot = 0

    def discard_pending(self) -> None:
        """Forget hook results that no step() will claim (e.g. on close)."""
        self._pending.clear()
        self._pending_sq.clear()
        self._pending_layer.clear()
        self._fwd_sums.clear()
        self._fwd_layer.clear()


def _first_seen(order: list[int]) -> list[int]:
    seen: set[int] = set()
    return [i for i in order if not (i in seen or seen.add(i))]


def _output_grad_reducer(
    ndim: int, unit_dim: int, units: int, project: bool, weights: "_ProjectionWeights"
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A function mapping an output gradient to (sum of squares, per-unit dead-test vector).

    The per-unit vector is non-negative and zero exactly for the units whose
    gradient is zero for every sample. Every variant reads the gradient in
    single contiguous passes without a gradient-sized temporary where it can:
    a strided reduction over the batch dim is ~5-25x slower on the CPU, and
    ``(g * g).sum(0)`` allocates and writes a copy of the gradient first.
    """
    f32 = torch.float32
    norm = torch.linalg.vector_norm
    other_dims = tuple(d for d in range(ndim) if d != unit_dim)

    def general(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Any strides and dtypes; per-unit sums of squares.
        g = g.detach()
        if g.dtype != f32:
            g = g.to(f32)  # fp16 squares overflow; accumulate in fp32
        per_unit = (g * g).sum(other_dims) if other_dims else g * g
        return per_unit.sum(), per_unit.reshape(-1)

    if ndim <= 1:
        return general

    if unit_dim == 1 and ndim >= 3:  # (N, C, *spatial): one norm per (sample, channel) row

        def channels(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if not g.is_contiguous():
                return general(g)
            n = g.shape[0]
            rows = norm(g.detach().reshape(n * units, -1), 2, 1, dtype=f32)
            per_unit = rows.view(n, units).square_().sum(0)
            return per_unit.sum(), per_unit

        return channels

    if not project:
        return general

    dot, mv = torch.dot, torch.mv
    cached: list = [None, None]  # the row count and the weights last used (a layer keeps its device)

    def last(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (*, U): the sum of squares by one BLAS dot; the dead-unit test by one
        # matrix-vector product with fixed random positive weights: sum_m r_m g[m, u]
        # is 0 when the unit's gradient is 0 for every sample, and (but for an exact
        # floating-point cancellation against random weights) not otherwise. The
        # caller takes the absolute value once for all calls (Recorder.fold).
        if not g.is_contiguous():
            return general(g)
        if g.requires_grad:  # only with backward(create_graph=True)
            g = g.detach()
        if g.dtype != f32:
            g = g.to(f32)  # fp16 squares overflow; accumulate in fp32
        rows = g if ndim == 2 else g.view(-1, units)  # (batch, units): no view op needed
        n = rows.shape[0]
        if n != cached[0]:
            cached[0], cached[1] = n, weights.get(n, rows.device)
        flat = g.view(-1)
        return dot(flat, flat), mv(rows.t(), cached[1])

    return last


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
