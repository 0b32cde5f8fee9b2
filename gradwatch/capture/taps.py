"""What runs inside the model's forward and backward: traceable taps into per-step accumulators.

Every module gradwatch watches gets one ``OutputTap``, registered as its forward hook.
The tap and the tensor hook it puts on the module's output (``grad_tap.py``) do nothing but
tensor ops into *cells*: small tensors declared when the monitor attaches (``cells.py``), rows
per layer and kind, that accumulate the current step; eager taps also count what they know
without a tensor (calls, samples, elements, their forward order) in numpy (``host_cells.py``),
which compiled code never touches. ``Recorder.record_step`` copies them into the step's row of
the buffer and zeroes what a step accumulates. There is no logging, no
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
- Cells have shape ``(1,)`` at least: a captured 0-d tensor mutated in compiled code loses the write.
- A tap holds three tensors of cells (its forward sum; its forward row; its backward row, the
  dead-unit evidence after the counts). What the taps of its device share, eager code reaches
  through one attribute (``shared``) and compiled code through one global by the tap's
  ``state_key``, an int equal across the device's layers (``cells.TAP_STATES``); its
  output-gradient hook is a method of the tap, so compiled code reaches that state by the same
  path (``cells.py`` says why: every tensor read is a guard and a graph input, every object
  reached by two paths a guard evaluated in Python).
- Per-layer facts a tap reads are tensors or values equal across layers of the same
  shape: an int constant that differs per layer (an offset, an index) makes every
  block of a regionally compiled model a new graph, and ``fullgraph=True`` then fails
  at the recompile limit.
- Whether the step is sampled is not a Python value dynamo guards on inside compiled code (that
  made each compiled shape two graphs, sampled and unsampled, and static shapes reached the
  recompile limit twice as fast). What only sampled steps record (the forward order, the output
  statistics, the output gradients' statistics) goes to opaque ops that read the host's flag when
  they run and write the cells on sampled steps only (``host_branch.py``): no statistic is
  compiled into the graph, and the graph stays cacheable. A branch of ``torch.cond`` on a CPU flag,
  which they replaced, cost as much a call but two compiled subgraphs per layer and direction and
  inductor's FX graph cache (benchmarks/RESULTS.md, twentieth session); computed at every step and
  masked (a torch where the ops are not in use), the backward measured 1.13x on the compiled
  Transformer against 1.03x, the forward 1.024 against 1.013. Eager taps read the Python bool and
  skip the work.
- The tensor hook returns its gradient unchanged (returning None fails under compiled autograd).
- Dynamo traces a tap's Python at every layer call it compiles, again after every graph break
  before it, and speculates the tensor hook's body for every hook it registers: compile time
  grows with every instruction and with every tensor a tap reads (each a fake tensor and guards,
  ~3-7 ms). The traced paths read no property, build no tuple and call nothing for a plain
  tensor's DTensor check (``type(x) is torch.Tensor``); a test bounds the instructions per layer
  against the unmonitored baseline's (benchmarks/RESULTS.md, twenty-third session).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat, registry
from . import host_branch, traced_output
from .cells import TAP_STATES, DeviceTapState, advance_clock
from .grad_passthrough import can_pass_through, pass_through
from .grad_statistics import GradStatistics
from .grad_tap import GradTap
from .host_cells import HostCells
from .layers import LayerSpec, grad_tensors
from .recording_flags import RecordingFlags
from ..distributed.sharding import local_tensor

_set_grad_enabled = torch._C._set_grad_enabled  # traceable, and cheaper than detach() per call


class InertWhenCopied:
    """A hook whose copies do nothing. A copy of the model (copy.deepcopy: an EMA model, a reference
    twin; pickling for torch.save(model)) copies its hook dicts: the copy's modules must not record
    into this monitor, so they get a hook that does nothing (:func:`inert_hook`)."""

    def __deepcopy__(self, memo: dict) -> Any:
        return inert_hook

    def __copy__(self) -> Any:
        return inert_hook

    def __reduce__(self) -> tuple:
        return (_inert, ())


class OutputTap(InertWhenCopied):
    """Forward hook of one layer: the forward non-finite check at every step, and on sampled
    steps the forward order and a tensor hook on the output for its gradient's statistics.

    Callable as ``hook(module, args, output)``; every attribute it reads is a tensor cell or a
    value that is the same for every layer of the same shape (see the module docstring).
    """

    def __init__(self, layer: LayerSpec, shared: DeviceTapState, *, host: HostCells, index: int,
                 forward_sum: torch.Tensor, forward_cells: torch.Tensor, grad_row: torch.Tensor) -> None:  # fmt: skip
        #: the recording flags, clock, sampling flag and projection weights of the layer's device (eager;
        #: compiled code reads them by ``state_key``: an object reached from every tap costs a guard
        #: per tap evaluated in Python at every call, ``cells.py``)
        self.shared = shared
        #: how compiled code reads ``shared``: ``TAP_STATES[state_key]`` (``cells.py``), here only (a second
        #: module reading that global would be a guard that both see the same dict), once a forward
        #: call, handed down; equal across the device's layers, so equal blocks share one graph
        self.state_key = shared.key
        self.name = layer.name  # read on the failure path only
        #: what each output gradient contributes (sum of squares, dead-unit evidence)
        self.grad_stats = GradStatistics(layer.units, layer.channel_first, shared.weights, grad_row.dtype)
        #: what the layer records of its output gradients (``on_output_grad`` hands it the shared state)
        self.grad_tap = GradTap(self.grad_stats, host=host, index=index, grad_row=grad_row, failed=self.failed)
        #: eager taps count output elements and their place in the forward on the host
        self.host, self.index = host, index
        self.forward_sum = forward_sum
        self.device = forward_sum.device  # (a property that makes a new object at every read)
        # The same cell as a 0-d tensor: the out= of a one-op sum (eager; see _check_forward).
        self.step_sum = forward_sum.data.view(())
        # flags.step at this tap's latest forward check, forward order and output statistics (eager)
        self.checked_at = self.ordered_at = self.stats_at = -1
        #: [first call | output elements | output statistics]: what compiled code reads, sliced at
        #: offsets equal across layers (one tensor guard, see ``cells.py``)
        self.forward_cells = forward_cells
        #: whether any output statistic is declared (a Python value: compiled code reads no tensor for it)
        self.records_outputs = forward_cells.numel() > 1
        # Views made once for eager taps (slicing is an op per call): the first-call clock value and
        # the output statistics (None: none is declared). Eager taps count the elements on the host.
        self.first_call = forward_cells[0:1]
        self.output_stats = forward_cells[2:] if self.records_outputs else None
        #: each statistic's 0-d views of them, for a first call that writes them one by one
        #: (``registry.outputs.write_all``; None: stacked)
        self.output_cells = registry.outputs.written_cells(self.output_stats) if self.records_outputs else None
        #: eager: reduce the output statistics in float64 (False: the last window's outputs allow
        #: float32, ``registry.outputs.float32_is_exact``); compiled code always does (fused casts)
        self.exact_outputs = True
        # Taps that record the same output too (MultiheadAttention's out_proj): set by HookSet.
        self.alias_taps: tuple["OutputTap", ...] = ()
        self.failure: BaseException | None = None  # the latest failure inside this tap, until step()
        #: compiled code with the KV cache on met an output it cannot hand through the gradient tap
        self.grad_left_out = False

    @property
    def flags(self) -> RecordingFlags:
        """The monitor's recording flags (``shared.flags``; compiled code reads them through ``shared``)."""
        return self.shared.flags

    def on_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The tensor hook on the layer's output in eager code: its gradient's statistics
        (``grad_tap.py``); returns ``grad`` unchanged. Compiled code registers
        :meth:`on_traced_output_grad`; both are methods of the tap, not of the gradient tap, so that
        the hook reaches the shared state by the forward hook's own path."""
        return GradTap.on_output_grad(self.grad_tap, grad, self.shared)  # by the class: see _record_outputs

    def on_traced_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """:meth:`on_output_grad` as compiled code registers it: the shared state read by ``state_key``
        (see ``__init__``). A method of its own rather than a branch in the eager hook: dynamo traces
        every instruction of it for every layer (``tests/compile``: a budget per layer)."""
        return GradTap.on_output_grad(self.grad_tap, grad, TAP_STATES[self.state_key])

    # ----------------------------------------------------------------- forward
    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """Record ``output``; returns None (the output unchanged), or in compiled code with the
        model's KV cache on, the output with a copy that carries the gradient tap (see
        ``capture/grad_passthrough.py``). Dynamo traces this at every layer call it compiles (and again
        after every graph break before it), so its traced path reads no property and builds no tuple."""
        try:
            if torch.compiler.is_compiling():
                shared = TAP_STATES[self.state_key]  # read once, handed down (see __init__)
                if shared.flags.active and torch.is_grad_enabled():
                    return OutputTap._record_outputs(self, output, shared)  # by the class: see _record_outputs
                return None
            if not self.shared.flags.active:
                return None
            if torch.is_grad_enabled():
                return self._record_eagerly(output)
            elif self.flags.sampling and _compat.in_reentrant_checkpoint():
                # Reentrant activation checkpointing runs its blocks' first forward without grad:
                # that call marks the forward order, nothing else; their recomputation inside
                # backward, with grad, records the rest but not the order. (Other calls without
                # grad, an evaluation, record nothing.)
                self._mark_forward_order(output)
        except Exception as exc:  # never break training; reported at step() (nothing raises when traced)
            self.failed(exc)
        return None

    def _record_eagerly(self, output: Any) -> Any:
        """Eager: on an unsampled step a plain tensor output of a layer no other tap records takes the
        forward check alone, without the general path's calls (~6 us less a layer call in context)."""
        flags = self.shared.flags
        if flags._sampling or type(output) is not torch.Tensor or self.alias_taps:
            return self._record_outputs(output, self.shared)
        if output.is_floating_point() and output.device == self.device:
            _set_grad_enabled(False)
            try:
                self._check_forward(output, flags)
            finally:
                _set_grad_enabled(True)
        return None

    def _mark_forward_order(self, output: Any) -> None:
        first = output if isinstance(output, torch.Tensor) else next(iter(grad_tensors(output)), None)
        if first is None or first.device != self.forward_sum.device:
            return
        for tap in (self, *self.alias_taps):
            tap._mark_order()

    def _mark_order(self) -> None:
        """Forward order (eager): at the layer's first call of the step, the device clock (which
        compiled calls count down) and the host's place among the eager calls since the last compiled
        one (``host_cells.py``); one op where compiled calls count the clock down (a step traced whole,
        ``detail="full"``, or the masked path), none where they order themselves on the host
        (``host_branch.mark_output``: the clock is then at its start, added on the host). Float32
        cells: the clock alone, counted down by every call."""
        shared = self.shared
        if not shared.host_order:
            advance_clock(self.first_call, shared.clock, shared.clock_tick)
            return
        flags = shared.flags
        if self.ordered_at != flags.step:
            self.ordered_at = flags.step
            host = self.host
            if not host_branch.IN_USE or flags.every_step:
                self.first_call.clamp_min_(shared.clock)  # compiled calls may have moved the clock
                host.order[self.index] = host.next_order()
            else:  # no compiled call marked its order before this one: the clock is at its start
                host.order[self.index] = shared.clock_scale.start + host.next_order()

    def _record_outputs(self, output: Any, shared: DeviceTapState) -> Any:
        """Record each output tensor of one call (eager, or traced); ``shared``: the device's state
        (``self.shared``, as compiled code reads it: ``__call__``)."""
        # Compiled code calls the taps' own methods through the class (``OutputTap._record_outputs(tap,
        # ...)``) or a module (``traced_output``), not the instance: a method read from an instance is
        # a guard per tap that its ``__dict__`` does not shadow it, checked at every call of the
        # compiled code (five a layer with the gradient tap's); read from the class, one guard for all
        # (benchmarks/RESULTS.md, fortieth session).
        if isinstance(output, torch.Tensor):
            if not output.is_floating_point():
                return None
            first, extras = output, ()
        else:
            tensors = grad_tensors(output)
            if not tensors:
                return None
            first, extras = tensors[0], tensors[1:]
        compiling = torch.compiler.is_compiling()
        record = traced_output.record_output if compiling else OutputTap.record_output
        record(self, first, False, shared)
        for tap in self.alias_taps:  # the same tensor: its forward check is this tap's (layers.ForwardAliases)
            record(tap, first, True, shared)  # (the same device: the same state)
        for extra in extras:  # e.g. an RNN's h_n: an output with the same units, when it has them
            if extra.ndim and self.grad_stats.judged(extra):
                record(self, extra, False, shared)
        if compiling and shared.flags.grads_through_function and first.requires_grad:
            if can_pass_through(output, first):
                return pass_through(output, first, (self, *self.alias_taps))
            self.grad_left_out = True  # said at the flush (ModelWatch.check_grads_left_out)
        return None

    def failed(self, exc: BaseException) -> None:
        """Keep the failure for step() to report (the failure path only: nothing here is traced)."""
        self.failure = exc
        self.flags.failed = True

    def record_output(self, out: torch.Tensor, checked: bool, shared: DeviceTapState) -> None:
        """Eager: fold one output into this step's cells (and, on sampled steps, watch its gradient);
        ``checked``: another tap's forward check reads this very tensor (an alias's: the host copies
        that sum into this layer's column, ``layers.ForwardAliases``), so this one takes none.
        ``shared``: the device's state. Traced code: ``traced_output.record_output``."""
        # The sum is non-finite exactly when the output holds a NaN or Inf (or overflows float32,
        # as alarming); in float32 at least, so that half-precision sums do not overflow. Grad
        # mode off rather than detach(): one op fewer per call, and no autograd node.
        if out.device != self.device:
            return  # a replica on another device (nn.DataParallel): its cells are not there
        flags = shared.flags
        sampling = flags.sampling
        _set_grad_enabled(False)
        try:
            # A DTensor output (SequenceParallel keeps one): this rank's piece (mesh.py combines them).
            if not checked:
                self._check_forward(local_tensor(out), flags)
            if sampling:
                self._record_sampled(out, flags.step)
        finally:
            _set_grad_enabled(True)  # the tap runs only with grad enabled
        if sampling and out.requires_grad:
            out.register_hook(self.on_output_grad)

    def record_sampled_call(self, out: torch.Tensor) -> None:
        """A compiled call's output on a sampled step, recorded as this eager tap records one (its
        forward order and output statistics; not its forward check, which the compiled code took):
        run on the host by the opaque op of ``host_branch.py``, in the order of the compiled calls.
        A failure is kept for step() to report, as inside the hook."""
        grad_mode = torch.is_grad_enabled()  # (off where compiled code runs: restored, not switched on)
        _set_grad_enabled(False)
        try:
            self._record_sampled(out, self.flags.step)
        except Exception as exc:  # never break training: reported at step()
            self.failed(exc)
        finally:
            _set_grad_enabled(grad_mode)

    def _record_sampled(self, out: torch.Tensor, step: int) -> None:
        """What a sampled step records of one output besides the forward check (eager, grad mode off):
        the forward order and the declared output statistics (registry/outputs.py)."""
        if not _compat.in_backward():  # a recomputation inside backward is not forward order
            self._mark_order()
        if self.records_outputs:
            self._record_output_stats(local_tensor(out), step)

    def _record_output_stats(self, local: torch.Tensor, step: int) -> None:
        """Eager: the declared output statistics of one call, written into the cells at the step's first
        call (``out=``) and added after it; the element count on the host."""
        stats = self.output_stats
        if self.stats_at != step:
            self.stats_at = step
            if self.output_cells is not None and registry.outputs.writes_directly(local):
                registry.outputs.write_all(local, self.exact_outputs, self.output_cells)
            else:
                registry.accumulate_all(local, stats.dtype, self.exact_outputs, into=stats)
        else:
            stats.add_(registry.accumulate_all(local, stats.dtype, self.exact_outputs))
        self.host.add(self.host.elements, self.index, local.numel())

    def _check_forward(self, out: torch.Tensor, flags: RecordingFlags) -> None:
        """Add the output's sum to the step's cell (eager): one op at a layer's first call of a step (a
        sum written straight into the cell, over whatever it held: the output is non-finite exactly
        when the sum is, or when it overflows float32, as alarming; counted in ``forward_writes``),
        two for the calls after it (compiled code: a sum and an add, which the compiler fuses;
        ``traced_output.record_output``)."""
        if self.checked_at != flags.step:
            self.checked_at = flags.step
            flags.forward_writes += 1
            torch.sum(out, dim=None, dtype=torch.float32, out=self.step_sum)
        else:
            self.step_sum.add_(out.sum(dtype=torch.float32))


def inert_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    """What a copied or unpickled model keeps of gradwatch's forward hook: nothing."""
    return None


def _inert() -> Any:
    return inert_hook


