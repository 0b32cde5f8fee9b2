"""The taps' cells: every layer's per-step accumulators, declared when the monitor attaches.

One flat storage per kind and device (``DeviceCells``; the backward counts and the dead-unit
evidence share one, a row per layer), so that ``Recorder.record_step`` reads and zeroes every
layer's cells with a few ops whatever the number of layers; each tap holds
aliases of its layer's part (``taps.OutputTap``). What every tap on a device shares (the
recording flags, the forward clock, the sampling flag, the projection weights) is one object,
``DeviceTapState``, that eager taps reach through one attribute (``shared``) and compiled taps
through one global, :data:`TAP_STATES`, by a key equal across the device's layers.

Why so few objects, measured on the compiled MLP (torch 2.13): dynamo checks a guard for every
tensor a compiled tap reads at every call of the compiled code, and an object reached by two
paths (``tap0.clock`` and ``tap1.clock``) costs an aliasing guard evaluated in Python (~2 us each).
With ~8 cells per tap and the shared flags reached from every tap and its gradient tap, the
compiled MLP checked 95 tensor guards and ~50 aliasing guards against its floor's 19 and none.
The one object reached from every tap (``tap.shared``) still cost one aliasing guard per layer
(``tap_k.shared is tap_0.shared``, ~1-2 us each warm: 128 of the 64-block MLP's ~580 us guard
check); read from the global by a constant key it is one path for every tap, checked in C++
(benchmarks/RESULTS.md, forty-second session).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import registry
from .buffer import stat_dtype
from .grad_statistics import FLOAT32_SAFE_NORM, ROW_COUNTS
from .host_cells import ClockScale, HostCells
from .layers import LayerSpec

if TYPE_CHECKING:  # (recording_flags.py imports host_branch.py, which imports this module)
    from .recording_flags import RecordingFlags

#: Projection weights are drawn once for up to this many rows (64 KiB); longer gradients
#: generate theirs (four more ops, on sampled steps only).
_PROJECTION_ROWS = 1 << 14


def advance_clock(first_call: torch.Tensor, clock: torch.Tensor, tick: float) -> None:
    """Forward order on the device: the clock counts down by ``tick`` at each call, so a layer's
    first-call cell (``first_call``, zeroed at a recorded step's start) keeps its first call's value,
    the largest."""
    first_call.clamp_min_(clock)
    clock.sub_(tick)


def add_recorded_output(output: torch.Tensor, row: torch.Tensor, clock: torch.Tensor, tick: float,
                        statistics: bool) -> None:  # fmt: skip
    """Add one output of a recorded step to its layer's forward row on the device ([first call |
    output elements | output statistics]): the forward order (:func:`advance_clock`) and, where
    ``statistics``, the elements and the declared output statistics (``registry/outputs.py``), exact
    (float64 where the dtype is). What compiled taps record at every step with ``detail="full"``
    (traced); the opaque op of ``host_branch.py`` records sampled steps by the tap's own code."""
    advance_clock(row[0:1], clock, tick)
    if statistics:
        row[1:2].add_(output.numel())
        row[2:].add_(registry.accumulate_all(output, row.dtype))


#: key -> the tap state of one device of an attached monitor (``DeviceTapState.key``): how compiled
#: taps reach it (``OutputTap.__call__``, ``OutputTap.on_traced_output_grad``), one path for every
#: layer (the module docstring says why). Keys are the smallest free, so that a monitor attached
#: after another one closed hands compiled code the same constant (as ``host_branch.register``); an
#: entry leaves at close() or when its monitor's cells are collected.
TAP_STATES: "dict[int, DeviceTapState]" = {}


def enter_states(states: "list[DeviceTapState]") -> None:
    """Give each of ``states`` a key in :data:`TAP_STATES`."""
    for state in states:
        state.key = next(k for k in itertools.count(1) if k not in TAP_STATES)
        TAP_STATES[state.key] = state


def release_states(states: "list[DeviceTapState]") -> None:
    """``states`` leave :data:`TAP_STATES` (a key another monitor took since is left to it)."""
    for state in states:
        if TAP_STATES.get(state.key) is state:
            del TAP_STATES[state.key]


def _alias(storage: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Cells ``storage[start:stop]`` as a tensor of its own version counter (see ``taps.py``)."""
    return storage.data[start:stop].data


class DeviceTapState:
    """What every tap of the layers on one device reads besides its own cells, in one object.

    Args:
        flags: the monitor's ``recording_flags.RecordingFlags``.
        clock: [1] the forward order's clock, counted down at each sampled compiled call.
        sampled: [1] bool, whether this step is sampled (what compiled taps read on the device).
        sampled_count: [1] the same as 1.0 or 0.0, in the stat dtype.
        weights: [_PROJECTION_ROWS] positive projection weights in [1, 2) (dead-unit evidence).
        clock_scale: where the clock starts and how far a compiled call counts it down.
    """

    def __init__(self, flags: "RecordingFlags", clock: torch.Tensor, sampled: torch.Tensor,
                 sampled_count: torch.Tensor, weights: torch.Tensor, clock_scale: ClockScale) -> None:  # fmt: skip
        self.flags = flags
        self.clock, self.sampled, self.sampled_count, self.weights = clock, sampled, sampled_count, weights
        self.clock_scale = clock_scale
        #: how far a compiled call counts the clock down; eager taps order themselves on the host
        #: (``host_order``) or count it down too (float32 cells: ``host_cells.ClockScale``)
        self.clock_tick, self.host_order = clock_scale.tick, clock_scale.host_order
        #: its key in :data:`TAP_STATES` while its monitor is attached (``enter_states``; 0: none)
        self.key = 0

    @classmethod
    def declare(cls, flags: "RecordingFlags", device: torch.device) -> "DeviceTapState":
        """The state of a fresh step on ``device`` (sampled, the clock at its start)."""
        dtype = stat_dtype(device)
        scale = ClockScale(dtype)
        generator = torch.Generator().manual_seed(20261129)
        return cls(
            flags,
            clock=torch.full((1,), scale.start, dtype=dtype, device=device),
            sampled=torch.ones(1, dtype=torch.bool, device=device),
            sampled_count=torch.ones(1, dtype=dtype, device=device),
            weights=torch.rand(_PROJECTION_ROWS, generator=generator).add_(1.0).to(device),
            clock_scale=scale,
        )

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.clock, self.sampled, self.sampled_count, self.weights


@dataclass
class DeviceCells:
    """The flat accumulators of the layers on one device, and where each layer's cells are.

    Each layer's cells of one kind are one contiguous row: a tap holds one alias per kind and
    slices it at offsets equal across layers (see the module docstring for why).
    """

    device: torch.device
    layers: np.ndarray  # global layer indices held here, in order
    #: [n] float32: the sum of each layer's outputs at this step (the forward check), zeroed at every step
    sums: torch.Tensor
    #: [n x (1 + K)] per layer: its first-call clock value of the step, then the declared output
    #: statistics' K accumulators (the output elements first; registry/outputs.py), in the stat dtype
    forward: torch.Tensor
    #: per layer, one contiguous row: its output gradients' sum of squares, calls and samples, then
    #: its per-unit evidence. One tensor per layer for its tap to read (``detail="full"``, the masked
    #: path) and to key its ops by (a zero-size view of it: ``grad_tap.row_key_of``): each tensor a
    #: compiled tap reads is a graph input, a tensor AOTAutograd saves for the backward, and a fake
    #: tensor with guards while dynamo traces (benchmarks/RESULTS.md, twenty-third session). (Two
    #: aliases of one storage handed to one op made inductor copy it at every call: one row, sliced
    #: inside, is not that.)
    backward: torch.Tensor
    #: [3n] where the layers' sums of squares, calls and samples are in ``backward`` (in that
    #: order, then layer order: ``grad_counts``)
    grad_index: torch.Tensor
    #: [units] where every layer's per-unit evidence is in ``backward``, in layer order
    unit_index: torch.Tensor
    #: [n] where each layer's row starts in ``backward``
    row_start: np.ndarray
    #: the clock, the sampling flag and the projection weights every tap here reads
    shared: DeviceTapState

    @property
    def n(self) -> int:
        return len(self.layers)

    @property
    def first_calls(self) -> torch.Tensor:
        """[n] each layer's first-call clock value of the step (a strided view)."""
        return self.forward[:, 0]

    @property
    def outputs(self) -> torch.Tensor:
        """[n x K] the declared output statistics' accumulators of the step (a strided view)."""
        return self.forward[:, 1:]

    def grad_counts(self) -> torch.Tensor:
        """[3 x n] the output gradients' sums of squares, calls and samples (gathered: one op)."""
        return self.backward.index_select(0, self.grad_index).view(3, self.n)

    def units(self) -> torch.Tensor:
        """[units] every layer's per-unit evidence, in layer order (gathered: one op)."""
        return self.backward.index_select(0, self.unit_index)

    @classmethod
    def declare(cls, flags: "RecordingFlags", device: torch.device, members: list[int], units: list[int],
                sums: torch.Tensor | None = None) -> "DeviceCells":  # fmt: skip
        """Zeroed cells on ``device`` for the layers ``members`` (global indices) with ``units`` units
        each; ``sums``: the [n] float32 forward sums where they live elsewhere (the recorder's
        per-step stage, ``per_step_rows.py``), else allocated here."""
        n, dtype = len(members), stat_dtype(device)
        sizes = ROW_COUNTS + np.array(units, dtype=np.int64)
        start = np.cumsum(sizes) - sizes  # each layer's row: its counts, then its units
        grad_index = np.concatenate([start + j for j in range(ROW_COUNTS)])
        unit_rows = (np.arange(s, s + u) for s, u in zip(start + ROW_COUNTS, units))
        unit_index = np.concatenate([np.zeros(0, dtype=np.int64), *unit_rows])
        return cls(
            device=device,
            layers=np.array(members, dtype=np.int64),
            sums=torch.zeros(n, dtype=torch.float32, device=device) if sums is None else sums,
            forward=torch.zeros(n, 1 + registry.accumulator_count(), dtype=dtype, device=device),
            backward=torch.zeros(int(sizes.sum()), dtype=dtype, device=device),
            grad_index=torch.as_tensor(grad_index, dtype=torch.int64, device=device),
            unit_index=torch.as_tensor(unit_index, dtype=torch.int64, device=device),
            row_start=start,
            shared=DeviceTapState.declare(flags, device),
        )

    def reset_step(self) -> None:
        """Zero what a sampled step accumulates: the backward cells and the forward clock (the
        taps write them on sampled steps only). The forward sums are zeroed at every step, by
        the copy that moves them into the step's row (``Recorder``)."""
        self.backward.zero_()
        self.forward.zero_()
        self.shared.clock.fill_(self.shared.clock_scale.start)

    def reset_window(self) -> None:
        """Zero every cell (a new window, or calls no step() will claim)."""
        self.sums.zero_()
        self.reset_step()


class Cells:
    """Every layer's accumulators, grouped by the device its parameters are on, and the taps that
    write them.

    Args:
        layers: the monitored layers.
        unit_count: each layer's declared units (its dead-unit evidence's length).
        forward_sums: [layers] float32 forward sums on the one device every layer is on, where they
            must live (the recorder's per-step stage, ``per_step_rows.py``); None: allocated here.
    """

    def __init__(self, layers: list[LayerSpec], unit_count: np.ndarray,
                 forward_sums: torch.Tensor | None = None) -> None:  # fmt: skip
        from . import host_branch  # (it imports this module)
        from .recording_flags import RecordingFlags  # (it imports host_branch, which imports this module)
        from .taps import OutputTap  # taps.py imports this module

        self.n_layers = len(layers)
        self.unit_count = unit_count
        by_device: dict[torch.device, list[int]] = {}
        for i, layer in enumerate(layers):
            by_device.setdefault(layer.params[0].device, []).append(i)
        self.devices: list[DeviceCells] = []
        self.taps: list[OutputTap] = []  # one per layer, in layer order
        self.flags = RecordingFlags()
        #: what eager taps count on the host (``host_cells.py``)
        self.host = HostCells(self.n_layers, ClockScale(torch.float64).tick)
        per_layer: dict[int, tuple[DeviceCells, int, int]] = {}
        for device, members in by_device.items():
            units = [int(unit_count[i]) for i in members]
            sums = forward_sums if forward_sums is not None and len(members) == self.n_layers else None
            cells = DeviceCells.declare(self.flags, device, members, units, sums)
            self.devices.append(cells)
            if not host_branch.IN_USE:  # only the masked path reads the sampling flag on the device
                self.flags.device_flags.append((cells.shared.sampled, cells.shared.sampled_count))
            for k, i in enumerate(members):
                per_layer[i] = (cells, k, int(cells.row_start[k]))
        states = [cells.shared for cells in self.devices]
        enter_states(states)
        # collected without close(): the keys go with the cells (the states hold nothing that reaches them)
        self._release = weakref.finalize(self, release_states, states)
        for i, layer in enumerate(layers):
            cells, k, start = per_layer[i]
            tap = OutputTap(
                layer,
                cells.shared,
                host=self.host,
                index=i,
                forward_sum=_alias(cells.sums, k, k + 1),
                forward_cells=cells.forward.data[k].data,
                grad_row=_alias(cells.backward, start, start + ROW_COUNTS + int(unit_count[i])),
            )
            self.taps.append(tap)
            # (how the ops find it: host_branch)
            self.flags.taps_at[host_branch.storage_place(tap.grad_tap.row_key)] = tap

    def release(self) -> None:
        """close(): the devices' tap states leave :data:`TAP_STATES` (compiled code still holding
        the monitor's taps finds none there: its guards fail, and it compiles again without them)."""
        self._release()

    @property
    def nbytes(self) -> int:
        """Bytes of the cells and projection weights on the devices."""
        return sum(
            t.numel() * t.element_size()
            for cells in self.devices
            for t in (cells.sums, cells.forward, cells.backward, cells.grad_index, cells.unit_index,
                      *cells.shared.tensors)
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
