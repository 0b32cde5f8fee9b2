"""What runs inside the model's forward and backward: traceable taps into per-step accumulators.

Every module gradwatch watches gets one ``OutputTap``, registered as its forward hook.
The tap and the tensor hook it puts on the module's output (``grad_tap.py``) do nothing but
tensor ops into *cells*: small tensors declared when the monitor attaches, one per layer and
statistic, that accumulate the current step; eager taps also count what they know without a
tensor (calls, samples, elements, their forward order) in numpy (``host_cells.py``), which
compiled code never touches. ``Recorder.record_step`` copies them into
the step's row of the buffer and zeroes what a step accumulates. There is no logging, no
host read, no Python container that grows, and no branch on strides in a tap, so the same
code runs eagerly and inside ``torch.compile(fullgraph=True)`` (whole model or regional),
and gives the same values in both.

The forward check, the only work at every step, is one op per layer in eager mode: a layer's
first call of a step writes its output's sum straight into its cell (``sum(..., out=)``; the
tap knows it is the first from ``RecordingFlags.step``, a Python int compiled code never reads);
later calls of the same step add to it. Inside compiled code it is a sum and an add, which the
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
- Whether the step is sampled is *data* inside compiled code, not a Python value dynamo
  guards on (that made each compiled shape two graphs, sampled and unsampled, and static
  shapes reached the recompile limit twice as fast). Forward: the order clock is computed at
  every step and kept where the device's flag says so (a few scalar ops); the output statistics
  in a branch the graph takes at run time on the host's flag (``torch.cond`` on a CPU tensor:
  reading it never waits for the device). Backward: the hook is on every step's output and
  computes its statistics in such a branch too. Computed at every step and masked, the backward's
  measured 1.13x on the compiled Transformer against 1.03x, the forward's 1.024 against 1.013 there
  (benchmarks/RESULTS.md), although they fuse into the forward check's kernel: float64 squares
  and a count over every output element. Eager taps read the Python bool and skip the work.
- The tensor hook returns its gradient unchanged (returning None fails under compiled autograd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _compat, registry
from .buffer import stat_dtype
from .grad_passthrough import can_pass_through, pass_through
from .grad_statistics import FLOAT32_SAFE_NORM, GradStatistics
from .grad_tap import GradTap, on_sampled_steps
from .host_cells import ClockScale, HostCells
from .layers import LayerSpec, grad_tensors
from ..distributed.sharding import local_tensor

#: Projection weights are drawn once for up to this many rows (64 KiB); longer gradients
#: generate theirs (four more ops, on sampled steps only).
_PROJECTION_ROWS = 1 << 14
_set_grad_enabled = torch._C._set_grad_enabled  # traceable, and cheaper than detach() per call


class RecordingFlags:
    """What the taps should do at the current step; one object shared by every tap.

    ``sampling``: record every statistic (output gradients, dead-unit evidence, the
    forward order), not only the forward check. Eager taps read the Python bool; compiled taps
    read its copy on their device (``device_flags``, written here only when the value changes:
    one small fill per device, twice a window with the default). ``active``: False while paused
    (a Python value compiled code guards on: pausing is one graph variant more). ``step``: the
    number of steps recorded so far.
    """

    def __init__(self) -> None:
        self._sampling = True
        #: (sampled as bool, sampled as 0/1 in the stat dtype) on each device that holds cells
        self.device_flags: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: the same on the host (a CPU bool): what compiled taps branch on (``torch.cond``)
        self.on_host = torch.ones((), dtype=torch.bool)
        #: every step is sampled (``detail="full"``; fixed at attach): compiled taps need no flag
        self.every_step = False
        #: the configurations with a KV-cache switch (``config.use_cache``, Hugging Face) in the model
        self.cache_configs: list[Any] = []
        #: compiled taps hand outputs through an autograd function instead of putting a tensor hook
        #: on them: True while the model's KV cache is on (see ``follow_cache_config``); a Python
        #: value compiled code guards on, read back at every step
        self.grads_through_function = False
        self.active = True
        #: Counts recorded steps, and every zeroing of the cells (a flush, calls no step() will
        #: claim): a tap that last wrote its cells at an earlier count is at its first call since
        #: they were zeroed, and writes instead of adding (eager only; compiled code never reads it).
        self.step = 0
        #: Some tap failed since the last step (its ``failure`` says how); reported at step(), not in the hook.
        self.failed = False

    @property
    def sampling(self) -> bool:
        return self._sampling

    @sampling.setter
    def sampling(self, value: bool) -> None:
        value = bool(value)
        if value != self._sampling:
            self._sampling = value
            self.on_host.fill_(value)
            for sampled, count in self.device_flags:
                sampled.fill_(value)
                count.fill_(float(value))

    def watch_cache_switch(self, model: torch.nn.Module) -> None:
        """Follow ``config.use_cache`` (a Hugging Face model's KV-cache switch) of every module of
        ``model`` that has one: the model itself, or one inside a user's wrapper (a Lightning module)."""
        configs = {}
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "use_cache"):
                configs[id(config)] = config
        self.cache_configs = list(configs.values())
        self.follow_cache_config()

    def follow_cache_config(self) -> None:
        """Compiled taps take output gradients through an autograd function while a KV cache in the
        model is on. A tensor hook registered in a frame that also builds a ``DynamicCache`` trips
        a dynamo bug (``capture/grad_passthrough.py``): dynamo drops the whole-model graph (8 graphs
        for 1 on a tiny GPT-2) and ``fullgraph=True`` fails. Read at attach and at every step (a
        getattr per configuration); with the cache off, the tensor hook (the path measured
        everywhere else) is kept."""
        if self.cache_configs:
            self.grads_through_function = any(getattr(c, "use_cache", False) for c in self.cache_configs)


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
    sampled: torch.Tensor  # [1] bool: whether this step is sampled, as compiled taps read it
    sampled_count: torch.Tensor  # [1] the same as 1.0 or 0.0, in the stat dtype
    #: [n x K] the declared output statistics' accumulators of the step (registry/outputs.py), sampled steps
    outputs: torch.Tensor
    weights: torch.Tensor  # [_PROJECTION_ROWS] positive projection weights in [1, 2)
    clock_scale: ClockScale  # where the clock starts and how far a compiled call counts it down

    @property
    def n(self) -> int:
        return len(self.layers)

    @classmethod
    def declare(cls, device: torch.device, members: list[int], units: int) -> "DeviceCells":
        """Zeroed cells on ``device`` for the layers ``members`` (global indices) with ``units`` units in all."""
        n, dtype = len(members), stat_dtype(device)
        scale = ClockScale(dtype)
        generator = torch.Generator().manual_seed(20261129)
        return cls(
            device=device,
            layers=np.array(members, dtype=np.int64),
            sums=torch.zeros(n, dtype=torch.float32, device=device),
            first_calls=torch.zeros(n, dtype=dtype, device=device),
            backward=torch.zeros(3 * n + units, dtype=dtype, device=device),
            clock=torch.full((1,), scale.start, dtype=dtype, device=device),
            sampled=torch.ones(1, dtype=torch.bool, device=device),
            sampled_count=torch.ones(1, dtype=dtype, device=device),
            outputs=torch.zeros(n * registry.accumulator_count(), dtype=dtype, device=device),
            weights=torch.rand(_PROJECTION_ROWS, generator=generator).add_(1.0).to(device),
            clock_scale=scale,
        )

    def reset_step(self) -> None:
        """Zero what a sampled step accumulates: the backward cells and the forward clock (the
        taps write them on sampled steps only). The forward sums are zeroed at every step, by
        the copy that moves them into the step's row (``Recorder``)."""
        self.backward.zero_()
        self.first_calls.zero_()
        self.outputs.zero_()
        self.clock.fill_(self.clock_scale.start)

    def reset_window(self) -> None:
        """Zero every cell (a new window, or calls no step() will claim)."""
        self.sums.zero_()
        self.first_calls.zero_()
        self.backward.zero_()
        self.outputs.zero_()
        self.clock.fill_(self.clock_scale.start)


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
        self.plan = RecordingFlags()
        #: what eager taps count on the host (``host_cells.py``)
        self.host = HostCells(self.n_layers, ClockScale(torch.float64).tick)
        per_layer: dict[int, tuple[DeviceCells, int, int]] = {}
        for device, members in by_device.items():
            n = len(members)
            units = [int(unit_count[i]) for i in members]
            cells = DeviceCells.declare(device, members, sum(units))
            self.devices.append(cells)
            self.plan.device_flags.append((cells.sampled, cells.sampled_count))
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
                    host=self.host,
                    index=i,
                    clock_scale=cells.clock_scale,
                    forward_sum=_alias(cells.sums, k, k + 1),
                    first_call=_alias(cells.first_calls, k, k + 1),
                    clock=cells.clock,
                    sampled=cells.sampled,
                    sampled_count=cells.sampled_count,
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
            for t in (cells.sums, cells.first_calls, cells.backward, cells.clock, cells.weights, cells.outputs,
                      cells.sampled, cells.sampled_count)
        )

    def follow_output_magnitudes(self, act_rms: dict[str, np.ndarray], out_grad_norm: dict[str, np.ndarray]) -> None:
        """At a flush, for the next window's eager taps: each layer's output statistics in float32
        where its act_rms of the window (``act_rms[name]``, over the steps) allows it
        (``registry.outputs.float32_is_exact``), else float64; a layer not in ``act_rms``: float64.
        The same for its output-gradient statistics on the CPU by ``out_grad_norm[name]``
        (``grad_statistics.FLOAT32_SAFE_NORM``); empty: float64 for every layer."""
        for tap in self.taps:
            values = act_rms.get(tap.name)
            tap.exact_outputs = values is None or not registry.outputs.float32_is_exact(values)
            norms = out_grad_norm.get(tap.name)
            tap.grad_stats.float32 = norms is not None and registry.outputs.float32_is_exact(norms, FLOAT32_SAFE_NORM)

    def set_unit_sums(self, enabled: bool) -> None:
        """Per-unit sums of squares (for dead_eps > 0) instead of the random projection."""
        for tap in self.taps:
            tap.grad_stats.unit_sums = enabled


class OutputTap:
    """Forward hook of one layer: the forward non-finite check at every step, and on sampled
    steps the forward order and a tensor hook on the output for its gradient's statistics.

    Callable as ``hook(module, args, output)``; every attribute it reads is a tensor cell or a
    value that is the same for every layer of the same shape (see the module docstring).
    """

    def __init__(self, layer: LayerSpec, plan: RecordingFlags, *, host: HostCells, index: int,
                 clock_scale: ClockScale, forward_sum: torch.Tensor, first_call: torch.Tensor, clock: torch.Tensor,
                 sampled: torch.Tensor, sampled_count: torch.Tensor, out_sq: torch.Tensor, calls: torch.Tensor,
                 samples: torch.Tensor, units: torch.Tensor, weights: torch.Tensor,
                 output_stats: torch.Tensor | None = None,
                 output_elements: torch.Tensor | None = None) -> None:  # fmt: skip
        self.plan = plan
        self.name = layer.name  # read on the failure path only
        #: what each output gradient contributes (sum of squares, dead-unit evidence)
        self.grad_stats = GradStatistics(layer.units, layer.channel_first, weights, out_sq.dtype)
        #: what the layer records of its output gradients
        self.grad_tap = GradTap(plan, self.grad_stats, host=host, index=index, out_sq=out_sq, calls=calls,
                                samples=samples, units=units, sampled=sampled, sampled_count=sampled_count,
                                failed=self.failed)  # fmt: skip
        #: the tensor hook on the output (sampled steps; every step inside compiled code)
        self.on_output_grad = self.grad_tap.on_output_grad
        #: eager taps count output elements and their place in the forward on the host
        self.host, self.index = host, index
        #: how far a compiled call counts the clock down; eager taps order themselves on the host (True)
        #: or count it down too (float32 cells: ``host_cells.ClockScale``)
        self.clock_tick, self.host_order = clock_scale.tick, clock_scale.host_order
        self.forward_sum = forward_sum
        # The same cell as a 0-d tensor: the out= of a one-op sum (eager; see _check_forward).
        self.step_sum = forward_sum.data.view(())
        # plan.step at this tap's latest forward check, forward order and output statistics (eager)
        self.checked_at = self.ordered_at = self.stats_at = -1
        self.first_call, self.clock = first_call, clock
        self.sampled, self.sampled_count = sampled, sampled_count
        self.output_stats = output_stats  # None: no output statistic is declared
        self.output_elements = output_elements
        #: eager: reduce the output statistics in float64 (False: the last window's outputs allow
        #: float32, ``registry.outputs.float32_is_exact``); compiled code always does (fused casts)
        self.exact_outputs = True
        # Taps that record the same output too (MultiheadAttention's out_proj): set by HookSet.
        self.also: tuple["OutputTap", ...] = ()
        self.failure: BaseException | None = None  # the latest failure inside this tap, until step()
        #: compiled code with the KV cache on met an output it cannot hand through the gradient tap
        self.grad_left_out = False

    # ----------------------------------------------------------------- forward
    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """Record ``output``; returns None (the output unchanged), or in compiled code with the
        model's KV cache on, the output with a copy that carries the gradient tap (see
        ``capture/grad_passthrough.py``)."""
        if not self.plan.active:
            return None
        try:
            if torch.is_grad_enabled():
                return self._record_outputs(output)
            elif not torch.compiler.is_compiling() and self.plan.sampling and _compat.in_reentrant_checkpoint():
                # Reentrant activation checkpointing runs its blocks' first forward without grad:
                # that call marks the forward order, nothing else; their recomputation inside
                # backward, with grad, records the rest but not the order. (Other calls without
                # grad, an evaluation, record nothing.)
                self._mark_forward_order(output)
        except Exception as exc:  # never break training; reported at step() (nothing raises when traced)
            self.failed(exc)
        return None

    def _mark_forward_order(self, output: Any) -> None:
        first = output if isinstance(output, torch.Tensor) else next(iter(grad_tensors(output)), None)
        if first is None or first.device != self.forward_sum.device:
            return
        for tap in (self, *self.also):
            tap._mark_order()

    def _mark_order(self) -> None:
        """Forward order (eager): at the layer's first call of the step, the device clock (which
        compiled calls count down) and the host's place among the eager calls since the last compiled
        one (``host_cells.py``); one op. Float32 cells: the clock alone, counted down by every call."""
        if not self.host_order:
            self._advance_clock()
            return
        step = self.plan.step
        if self.ordered_at != step:
            self.ordered_at = step
            self.first_call.clamp_min_(self.clock)
            self.host.order[self.index] = self.host.next_order()

    def _advance_clock(self) -> None:
        """Forward order on the device alone (compiled code with ``detail="full"``, float32 cells): the
        clock counts down, so a layer's first call keeps the largest value."""
        self.first_call.clamp_min_(self.clock)
        self.clock.sub_(self.clock_tick)

    def _record_outputs(self, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            tensors = [output] if output.is_floating_point() else []
        else:
            tensors = grad_tensors(output)
        if not tensors:
            return None
        first = tensors[0]
        for tap in (self, *self.also):
            tap.record_output(first)
        for extra in tensors[1:]:  # e.g. an RNN's h_n: an output with the same units, when it has them
            if extra.ndim and self.grad_stats.judged(extra):
                self.record_output(extra)
        if self.plan.grads_through_function and first.requires_grad and torch.compiler.is_compiling():
            if can_pass_through(output, first):
                return pass_through(output, first, (self, *self.also))
            self.grad_left_out = True  # said at the flush (ModelWatch.check_grads_left_out)
        return None

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
        if torch.compiler.is_compiling():
            self._record_output_traced(out)
            return
        plan = self.plan
        sampling = plan.sampling
        _set_grad_enabled(False)
        try:
            # A DTensor output (SequenceParallel keeps one): this rank's piece (mesh.py combines them).
            self._check_forward(local_tensor(out), plan)
            if sampling:
                if not _compat.in_backward():  # a recomputation inside backward is not forward order
                    self._mark_order()
                if self.output_stats is not None:  # the declared output statistics (registry/outputs.py)
                    self._record_output_stats(local_tensor(out), plan.step)
        finally:
            _set_grad_enabled(True)  # the tap runs only with grad enabled
        if sampling and out.requires_grad:
            out.register_hook(self.on_output_grad)

    def _record_output_stats(self, local: torch.Tensor, step: int) -> None:
        """Eager: the declared output statistics of one call, written into the cells at the step's first
        call (``out=``) and added after it; the element count on the host."""
        stats = self.output_stats
        if self.stats_at != step:
            self.stats_at = step
            registry.accumulate_all(local, stats.dtype, self.exact_outputs, into=stats)
        else:
            stats.add_(registry.accumulate_all(local, stats.dtype, self.exact_outputs))
        self.host.add(self.host.elements, self.index, local.numel())

    def _record_output_traced(self, out: torch.Tensor) -> None:
        """``record_output`` inside compiled code: every step's graph is the sampled one, and what
        only sampled steps record is kept where this device's flag says so (see the module
        docstring); with ``detail="full"`` (a constant for the compiled code) every step keeps it.
        The forward check's sum fuses into the kernel that makes the output or reads it next."""
        local = local_tensor(out)
        every_step = self.plan.every_step
        with torch.no_grad():
            self.forward_sum.add_(local.sum(dtype=torch.float32))
            count = self.sampled_count
            if every_step:
                self._advance_clock()
            else:
                # The clock is finite and non-negative, so a product keeps it or makes it 0, which
                # the first-call cell (zeroed at sampled steps, never negative) ignores.
                self.first_call.clamp_min_(self.clock * count)
                self.clock.sub_(count * self.clock_tick)
            if self.output_stats is not None:
                self.output_stats.add_(self._traced_output_values(local, every_step))
                self.output_elements.add_(local.numel() if every_step else count * local.numel())
        if out.requires_grad and not self.plan.grads_through_function:
            out.register_hook(self.on_output_grad)

    def _traced_output_values(self, local: torch.Tensor, every_step: bool) -> torch.Tensor:
        """The output statistics' accumulators of one call inside compiled code: at every step with
        ``detail="full"``; otherwise computed on sampled steps only, in a branch the graph takes at
        run time on the host's flag (``torch.cond``, as the output-gradient tap does), and zeros on
        the others. Computed at every step and masked, their float64 squares and count over every
        output element cost the compiled MLP and Transformer ~1 point of their step
        (benchmarks/RESULTS.md, fifteenth session); that stays the path of a torch without
        ``torch.cond`` in hooks, and of a model whose KV cache is on: ``torch.cond`` in a frame
        that builds a ``DynamicCache`` fails ``fullgraph=True`` on a tiny GPT-2 (dynamo loses an
        attribute the cache set, as with the tensor hook: ``follow_cache_config``)."""
        dtype = self.output_stats.dtype
        if every_step:
            return registry.accumulate_all(local, dtype)
        width = self.output_stats.numel()
        branch = _compat.COND_IN_HOOKS and not self.plan.grads_through_function
        (values,) = on_sampled_steps(self.plan, self.sampled, lambda t: (registry.accumulate_all(t, dtype),),
                                     lambda t: (t.new_zeros(width, dtype=dtype),), local, branch)  # fmt: skip
        return values

    def _check_forward(self, out: torch.Tensor, plan: RecordingFlags) -> None:
        """Add the output's sum to the step's cell (eager): one op at a layer's first call of a step (a
        sum written straight into the cell, which the step's copy zeroed: the output is non-finite
        exactly when the sum is, or when it overflows float32, as alarming), two for the calls after
        it (compiled code: a sum and an add, which the compiler fuses; ``_record_output_traced``)."""
        if self.checked_at != plan.step:
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


def inert_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    """What a copied or unpickled model keeps of gradwatch's forward hook: nothing."""
    return None


def _inert() -> Any:
    return inert_hook


