"""What runs inside the model's forward and backward: traceable taps into per-step accumulators.

Every module gradwatch watches gets one ``OutputTap``, registered as its forward hook.
The tap and the tensor hook it puts on the module's output do nothing but tensor ops
into *cells*: small tensors declared when the monitor attaches, one per layer and
statistic, that accumulate the current step. ``Recorder.record_step`` copies them into
the step's row of the buffer and zeroes what a step accumulates. There is no logging, no
host read, no Python container that grows, and no branch on strides in a tap, so the same
code runs eagerly and inside ``torch.compile(fullgraph=True)`` (whole model or regional),
and gives the same values in both.

The forward check, the only work at every step, is one op per layer in eager mode: a layer's
first call of a step writes its output's sum straight into its cell (``sum(..., out=)``; the
tap knows it is the first from ``Plan.step``, a Python int compiled code never reads); later
calls of the same step add to it. Inside compiled code it is a sum and an add, which the
compiler fuses into one kernel.

What dynamo needs, each measured on torch 2.13 (tests/test_compile.py keeps them true):

- A cell is a ``.data`` alias of a slice of one flat storage per device: it shares the
  storage, so ``record_step`` reads and zeroes every cell with one op, but not the
  storage's version counter. A compiled region saves the cells its backward hooks
  write; a write into a saved tensor between its forward and its backward (another
  region's forward, an eager hook's backward) fails autograd's version check, so the
  backward cells are per layer and the forward cells are never saved. A plain view
  (``t[i]``, ``t.detach()``) would share the counter, and views of one base also fail
  fake-tensor conversion.
- Cells have shape ``(1,)``: a captured 0-d tensor mutated in compiled code loses the write.
- Per-layer facts a tap reads are tensors or values equal across layers of the same
  shape: an int constant that differs per layer (an offset, an index) makes every
  block of a regionally compiled model a new graph, and ``fullgraph=True`` then fails
  at the recompile limit.
- The sampling flag (``Plan.sampling``) is a Python bool read in the tap: dynamo guards
  on it, so the default's sampled and unsampled steps cost two graph variants, no more.
- The tensor hook returns its gradient unchanged (returning None fails under compiled autograd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _compat, registry
from .buffer import stat_dtype
from .layers import LayerSpec, grad_tensors
from ..distributed.sharding import local_tensor

#: Projection weights are drawn once for up to this many rows (64 KiB); longer gradients
#: generate theirs (four more ops, on sampled steps only).
_PROJECTION_ROWS = 1 << 14
#: The forward clock starts here and counts down: a layer's first call keeps the largest value.
CLOCK_START = float(1 << 24)
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_set_grad_enabled = torch._C._set_grad_enabled  # traceable, and cheaper than detach() per call


class Plan:
    """What the taps should do at the current step; one object shared by every tap.

    ``sampling``: record every statistic (output gradients, dead-unit evidence, the
    forward order), not only the forward check. ``active``: False while paused. ``step``: the
    number of steps recorded so far.
    """

    def __init__(self) -> None:
        self.sampling = True
        self.active = True
        #: Counts recorded steps: a tap that last checked an output at an earlier count is at its
        #: step's first call (eager only; compiled code never reads it).
        self.step = 0
        #: Some tap failed since the last step (its ``failure`` says how); reported at step(), not in the hook.
        self.failed = False


def _alias(storage: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Cells ``storage[start:stop]`` as a tensor of its own version counter (see the module docstring)."""
    return storage.data[start:stop].data


@dataclass
class DeviceCells:
    """The flat accumulators of the layers on one device, and where each layer's cells are."""

    device: torch.device
    layers: np.ndarray  # global layer indices held here, in order
    #: [n] float32: the sum of each layer's outputs at this step (the forward check), zeroed at every step
    sums: torch.Tensor
    first_calls: torch.Tensor  # [n] first-call clock value of the step, in the stat dtype
    backward: torch.Tensor  # [sum of squares (n) | calls (n) | samples (n) | per-unit evidence (units)]
    clock: torch.Tensor  # [1], counts down at each sampled forward call
    #: [n x K] the declared output statistics' accumulators of the step (registry/outputs.py), sampled steps
    outputs: torch.Tensor
    weights: torch.Tensor  # [_PROJECTION_ROWS] positive projection weights in [1, 2)

    @property
    def n(self) -> int:
        return len(self.layers)

    def reset_step(self) -> None:
        """Zero what a sampled step accumulates: the backward cells and the forward clock (the
        taps write them on sampled steps only). The forward sums are zeroed at every step, by
        the copy that moves them into the step's row (``Recorder``)."""
        self.backward.zero_()
        self.first_calls.zero_()
        self.outputs.zero_()
        self.clock.fill_(CLOCK_START)

    def reset_window(self) -> None:
        """Zero every cell (a new window, or calls no step() will claim)."""
        self.sums.zero_()
        self.first_calls.zero_()
        self.backward.zero_()
        self.outputs.zero_()
        self.clock.fill_(CLOCK_START)


class Cells:
    """Every layer's accumulators, grouped by the device its parameters are on."""

    def __init__(self, layers: list[LayerSpec], unit_count: np.ndarray) -> None:
        self.n_layers = len(layers)
        self.unit_count = unit_count
        by_device: dict[torch.device, list[int]] = {}
        for i, layer in enumerate(layers):
            by_device.setdefault(layer.params[0].device, []).append(i)
        self.devices: list[DeviceCells] = []
        self.taps: list[OutputTap] = []
        self.plan = Plan()
        per_layer: dict[int, tuple[DeviceCells, int, int]] = {}
        for device, members in by_device.items():
            n = len(members)
            units = [int(unit_count[i]) for i in members]
            dtype = stat_dtype(device)
            generator = torch.Generator().manual_seed(20261129)
            cells = DeviceCells(
                device=device,
                layers=np.array(members, dtype=np.int64),
                sums=torch.zeros(n, dtype=torch.float32, device=device),
                first_calls=torch.zeros(n, dtype=dtype, device=device),
                backward=torch.zeros(3 * n + sum(units), dtype=dtype, device=device),
                clock=torch.full((1,), CLOCK_START, dtype=dtype, device=device),
                outputs=torch.zeros(n * registry.accumulator_count(), dtype=dtype, device=device),
                weights=torch.rand(_PROJECTION_ROWS, generator=generator).add_(1.0).to(device),
            )
            self.devices.append(cells)
            offset = 3 * n
            for k, i in enumerate(members):
                per_layer[i] = (cells, k, offset)
                offset += units[k]
        stats = registry.accumulator_count()
        for i, layer in enumerate(layers):
            cells, k, offset = per_layer[i]
            n = cells.n
            self.taps.append(
                OutputTap(
                    layer,
                    self.plan,
                    forward_sum=_alias(cells.sums, k, k + 1),
                    first_call=_alias(cells.first_calls, k, k + 1),
                    clock=cells.clock,
                    out_sq=_alias(cells.backward, k, k + 1),
                    calls=_alias(cells.backward, n + k, n + k + 1),
                    samples=_alias(cells.backward, 2 * n + k, 2 * n + k + 1),
                    units=_alias(cells.backward, offset, offset + int(unit_count[i])),
                    weights=cells.weights,
                    output_stats=_alias(cells.outputs, k * stats + 1, (k + 1) * stats) if stats else None,
                    output_elements=_alias(cells.outputs, k * stats, k * stats + 1) if stats else None,
                )
            )

    @property
    def nbytes(self) -> int:
        """Bytes of the cells and projection weights on the devices."""
        return sum(
            t.numel() * t.element_size()
            for cells in self.devices
            for t in (cells.sums, cells.first_calls, cells.backward, cells.clock, cells.weights, cells.outputs)
        )

    def set_unit_sums(self, enabled: bool) -> None:
        """Per-unit sums of squares (for dead_eps > 0) instead of the random projection."""
        for tap in self.taps:
            tap.unit_sums = enabled


class OutputTap:
    """Forward hook of one layer: the forward non-finite check at every step, and on sampled
    steps the forward order and a tensor hook on the output for its gradient's statistics.

    Callable as ``hook(module, args, output)``; every attribute it reads is a tensor cell or a
    value that is the same for every layer of the same shape (see the module docstring).
    """

    def __init__(self, layer: LayerSpec, plan: Plan, *, forward_sum: torch.Tensor, first_call: torch.Tensor,
                 clock: torch.Tensor, out_sq: torch.Tensor, calls: torch.Tensor, samples: torch.Tensor,
                 units: torch.Tensor, weights: torch.Tensor, output_stats: torch.Tensor | None = None,
                 output_elements: torch.Tensor | None = None) -> None:  # fmt: skip
        self.plan = plan
        self.name = layer.name  # read on the failure path only
        self.layer_units = int(layer.units)
        self.channel_first = bool(layer.channel_first)
        self.forward_sum = forward_sum
        # The same cell as a 0-d tensor: the out= of a one-op sum (eager; see record_output).
        self.step_sum = forward_sum.data.view(())
        self.checked_at = -1  # plan.step when this tap last checked an output (eager)
        self.first_call = first_call
        self.clock = clock
        self.out_sq = out_sq
        self.calls = calls
        self.samples = samples
        self.units = units
        self.weights = weights
        self.output_stats = output_stats  # None: no output statistic is declared
        self.output_elements = output_elements
        # Taps that record the same output too (MultiheadAttention's out_proj): set by HookSet.
        self.also: tuple["OutputTap", ...] = ()
        # Per-unit evidence as sums of squares (dead_eps > 0) instead of a random projection.
        self.unit_sums = False
        self.failure: BaseException | None = None  # the latest failure inside this tap, until step()

    # ----------------------------------------------------------------- forward
    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.plan.active:
            return
        try:
            if torch.is_grad_enabled():
                self._record_outputs(output)
            elif self.plan.sampling and _compat.in_reentrant_checkpoint():
                # Reentrant activation checkpointing runs its blocks' first forward without grad:
                # that call marks the forward order, nothing else; their recomputation inside
                # backward, with grad, records the rest but not the order. (Other calls without
                # grad, an evaluation, record nothing.)
                self._mark_forward_order(output)
        except Exception as exc:  # never break training; reported at step() (nothing raises when traced)
            self.failed(exc)

    def _mark_forward_order(self, output: Any) -> None:
        first = output if isinstance(output, torch.Tensor) else next(iter(grad_tensors(output)), None)
        if first is None or first.device != self.forward_sum.device:
            return
        for tap in (self, *self.also):
            tap._advance_clock()

    def _advance_clock(self) -> None:
        """Forward order: the clock counts down, so a layer's first call keeps the largest value."""
        self.first_call.clamp_min_(self.clock)
        self.clock.sub_(1.0)

    def _record_outputs(self, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            if output.is_floating_point():
                self.record_output(output)
            return
        tensors = grad_tensors(output)
        if not tensors:
            return
        self.record_output(tensors[0])
        for tap in self.also:
            tap.record_output(tensors[0])
        for extra in tensors[1:]:  # e.g. an RNN's h_n: an output with the same units, when it has them
            if extra.ndim and self.layer_units and extra.shape[self.unit_dim(extra.ndim)] == self.layer_units:
                self.record_output(extra)

    def failed(self, exc: BaseException) -> None:
        """Keep the failure for step() to report (the failure path only: nothing here is traced)."""
        self.failure = exc
        self.plan.failed = True

    def record_output(self, out: torch.Tensor) -> None:
        """Fold one output into this step's cells (and, on sampled steps, watch its gradient)."""
        # The sum is non-finite exactly when the output holds a NaN or Inf (or overflows float32,
        # as alarming); in float32 at least, so that half-precision sums do not overflow. Grad
        # mode off rather than detach(): one op fewer per call, and no autograd node.
        if out.device != self.forward_sum.device:
            return  # a replica on another device (nn.DataParallel): its cells are not there
        plan = self.plan
        sampling = plan.sampling
        _set_grad_enabled(False)
        try:
            # A DTensor output (SequenceParallel keeps one): this rank's piece (mesh.py combines them).
            self._check_forward(local_tensor(out), plan)
            if sampling:
                if not _compat.in_backward():  # a recomputation inside backward is not forward order
                    self._advance_clock()
                if self.output_stats is not None:  # the declared output statistics (registry/outputs.py)
                    local = local_tensor(out)
                    self.output_stats.add_(registry.accumulate_all(local, self.output_stats.dtype))
                    self.output_elements.add_(local.numel())
        finally:
            _set_grad_enabled(True)  # the tap runs only with grad enabled
        if sampling and out.requires_grad:
            out.register_hook(self.on_output_grad)

    def _check_forward(self, out: torch.Tensor, plan: Plan) -> None:
        """Add the output's sum to the step's cell: one op at a layer's first call of a step in eager
        mode (a sum written straight into the cell, which the step's copy zeroed: the output is
        non-finite exactly when the sum is, or when it overflows float32, as alarming), two for
        the calls after it and inside compiled code (a sum, then an add, which the compiler fuses)."""
        if torch.compiler.is_compiling():
            self.forward_sum.add_(out.sum(dtype=torch.float32))
        elif self.checked_at != plan.step:
            self.checked_at = plan.step
            torch.sum(out, dim=None, dtype=torch.float32, out=self.step_sum)
        else:
            self.step_sum.add_(out.sum(dtype=torch.float32))

    # A copy of the model (copy.deepcopy: an EMA model, a reference twin; pickling for
    # torch.save(model)) copies its hook dicts: the copy's modules must not record into this
    # monitor, so they get a hook that does nothing.
    def __deepcopy__(self, memo: dict) -> Any:
        return inert_hook

    def __copy__(self) -> Any:
        return inert_hook

    def __reduce__(self) -> tuple:
        return (_inert, ())

    def unit_dim(self, ndim: int) -> int:
        return 1 if self.channel_first and ndim >= 2 else ndim - 1

    # ---------------------------------------------------------------- backward
    def on_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Tensor hook on the output: sum of squares (float64), calls and dead-unit evidence."""
        grad_mode = torch.is_grad_enabled()  # on only in a backward with create_graph=True
        _set_grad_enabled(False)
        try:
            self._record_grad(local_tensor(grad))
        except Exception as exc:  # as in __call__
            self.failed(exc)
        finally:
            _set_grad_enabled(grad_mode)
        return grad

    def _record_grad(self, g: torch.Tensor) -> None:
        """Sum of squares, exact at any magnitude: norms of rows accumulated in float64 (on the CPU a
        float64 reduction over rows costs a third of one over the whole tensor), then their squares
        summed; the rows are also what the dead-unit evidence is made of."""
        acc = self.out_sq.dtype
        self.calls.add_(1.0)
        ndim = g.ndim
        dim = self.unit_dim(ndim) if ndim else 0
        judged = ndim > 0 and self.layer_units > 0 and g.shape[dim] == self.layer_units
        if ndim >= 3 and dim == 1:
            # (N, C, *spatial): one norm per (sample, channel) over positions, in any layout.
            rows = torch.linalg.vector_norm(g, 2, dim=tuple(range(2, ndim)), dtype=acc)
            self.out_sq.add_(rows.square().sum())
            if judged:
                # Per channel over samples and positions. The samples are the N examples, not
                # N x positions: neighbouring positions of one image are not independent evidence.
                evidence = torch.linalg.vector_norm(rows, 2, dim=0)
                self.units.addcmul_(evidence, evidence)
                self.samples.add_(float(g.shape[0]))
            return
        # (*, U): every leading index is a row (a sample, or a token of one).
        rows = g if ndim == 2 else g.reshape(-1, g.shape[-1]) if ndim > 2 else g.reshape(1, -1)
        row_norms = torch.linalg.vector_norm(rows, 2, dim=1, dtype=acc)
        self.out_sq.add_(torch.dot(row_norms, row_norms))
        if not judged:
            return  # units unknown, or an output without the declared units: no dead-unit evidence
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.float()  # half-precision squares overflow
        n = rows.shape[0]
        if self.unit_sums:  # dead_eps > 0: per-unit norms, compared with dead_eps
            evidence = torch.linalg.vector_norm(rows, 2, dim=0)
        else:
            # Projection on fixed positive weights (one matrix-vector product): zero for a unit
            # whose gradient is zero for every row, and (but for an exact cancellation against
            # random weights) not otherwise. Squared when added, so that calls never cancel.
            weights = self.weights[:n] if n <= self.weights.shape[0] else _generated_weights(n, rows.device)
            if weights.dtype != rows.dtype:
                weights = weights.to(rows.dtype)
            evidence = torch.mv(rows.t(), weights)
        self.units.addcmul_(evidence, evidence)
        self.samples.add_(float(n))


def inert_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    """What a copied or unpickled model keeps of gradwatch's forward hook: nothing."""
    return None


def _inert() -> Any:
    return inert_hook


def _generated_weights(n: int, device: torch.device) -> torch.Tensor:
    """Deterministic weights in [1, 2) for more rows than the drawn ones cover (the golden-ratio sequence)."""
    return torch.arange(n, dtype=torch.float32, device=device).mul_(_GOLDEN).frac_().add_(1.0)
