"""Which reduction each parameter column takes, and how the columns group for it.

The columns of ``param_stats.ParamStats`` are ordered by key (device, dtype, strategy) at attach,
so that each group of equal keys is one contiguous slice written with one ``torch.stack(..., out=)``.
This module keeps that plan: the groups, the common case's single group (reduced without the
general loop), the CPU's float32 result slots, and the moves that keep the plan true as the run
goes on: a cast after attaching regroups the columns, and tensors whose float32 squares underflow
move into (or grow out of) the tiny tier. The order of the columns never changes; only the runs
of equal keys split or join.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .reductions import TinyStats, _CpuSlots
from ..distributed.sharding import is_dtensor

log = logging.getLogger("gradwatch")

# CPU float32 tensors at least this large go to CpuBlasStats; smaller ones (biases,
# norms) to one foreach call per group, which saves a Python dispatch per tensor.
CPU_LARGE = 1 << 15
#: CPU float32 tensors at least this large are read by a BLAS ``dot`` on the steps that need sums
#: of squares only (``ForeachStats.reduce``'s ``dots_from``), not by ``_foreach_norm``. Timed right
#: after a real backward, where these reads run (benchmarks/RESULTS.md, thirty-seventh session): the
#: MLP 8x512's gradients 580-600 us by dots against 720-890 by one foreach norm, the Transformer's
#: 1.06-1.08 ms against 1.31, ResNet-18's 2.7 ms against 4.1; below ~64K elements a dot's own call
#: costs more than it saves (the CNN's 36K-element convolutions: +55 us for four). The dot is the
#: more accurate too (float32 sums of squares against float64 on 2.4M normal values: 1e-5 relative,
#: the float32 norm's square 8e-5).
DOT_MIN = 1 << 16

#: The key's third field for tensors whose float32 squares underflow (``TinyStats``).
TINY = "tiny"
#: The CPU dtypes whose sums the float32 slots hold and check (float64 and complex go elsewhere).
_SLOT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ModelMoved(RuntimeError):
    """The model's parameters moved to another device after the monitor attached."""

    def __init__(self, was: torch.device, now: torch.device) -> None:
        super().__init__(
            f"the model's parameters moved from {was} to {now} after gradwatch attached, and its "
            f"statistics live on {was}: create the monitor after moving the model (model.to(device), "
            f"or materialising a model built on the meta device, first), or close() this monitor and "
            f"create a new one. gradwatch stops recording"
        )
        self.was, self.now = was, now


@dataclass
class Group:
    """Parameters reduced together: one strategy, one contiguous slice of columns."""

    key: tuple | None  # (device, dtype, large CPU float32); None: reduced one by one (DTensors, sparse)
    cols: slice
    params: list[torch.nn.Parameter]
    #: the first of the trailing tensors read by a dot where sums of squares are all a step needs
    #: (:func:`dots_from`); ``len(params)``: none
    dots_from: int


class ColumnGroups:
    """The reduction plan of a fixed, ordered list of parameter columns.

    Args:
        params: the columns' parameters, already ordered by ``keys`` (each key's columns contiguous).
        keys: each column's ``group_key``; None for columns reduced one by one (DTensors, sparse,
            gradients read elsewhere).
        cpu_fast: whether CPU tensors take the CPU's own path (``param_stats.CPU_FAST_PATH``).
        dense_whole: every gradient is dense, local and whole on this rank (nothing sharded, no
            DTensor, no gradient kept elsewhere): the condition for the common case's direct call.
    """

    def __init__(self, params: list[torch.nn.Parameter], keys: list, cpu_fast: bool, dense_whole: bool) -> None:
        self.params = params
        self.cpu_fast = cpu_fast
        self._dense_whole = dense_whole
        self.slots: _CpuSlots | None = None
        #: columns to move into or out of the tiny tier at the next step (their squares underflow float32)
        self.retier: set[int] = set()
        self.regroup(keys)

    def regroup(self, keys: list) -> None:
        """Group the columns (in their fixed order) by key: contiguous runs of equal keys."""
        self.keys = keys
        #: the groups of a step that records every statistic (max |g| included)
        self.groups = self._make_groups(keys)
        # Steps without max |g| (detail="standard", unsampled) need sums of squares only: one
        # foreach kernel per (device, dtype), large CPU tensors included (one op instead of a
        # view and a dot per tensor; foreach_norm reads a cold tensor about as fast).
        self.light_groups = self._make_groups([None if k is None else (k[0], k[1], k[2] == TINY and TINY) for k in keys])
        cpu_sizes = [g.cols.stop - g.cols.start for g in self.groups if g.key is not None and g.key[0].type == "cpu"]
        needed = max(cpu_sizes + [len(g.params) for g in self.light_groups if slot_checked(g.key, self.cpu_fast)],
                     default=0)  # fmt: skip
        # Slots large enough are kept: a vanishing model re-plans as its tensors cross the tiny
        # line one after another, and new slots cost ~3 ms per re-plan at 500 tensors (unbind).
        self.ensure_slots(needed)
        # The common case, reduced without the general loop's layers (``ParamStats._record_whole``):
        # one group of every column, dense and whole on this rank, reduced by ``ForeachStats`` (into
        # the float32 slots on the CPU's own path). Each Python call there runs right after backward
        # at ~10x its warm price (benchmarks/RESULTS.md, twenty-fifth session).
        light = self.light_groups
        key = light[0].key if len(light) == 1 else None
        simple = self._dense_whole and key is not None and key[2] != TINY and not key[1].is_complex and (
            slot_checked(key, self.cpu_fast) or not self.on_cpu_path(key))  # (CPU float64: counted, elsewhere)
        #: the common case's one group, or None
        self.whole_group = light[0] if simple else None
        #: whether the common case's group reduces into the CPU slots
        self.whole_slots = simple and slot_checked(key, self.cpu_fast)

    def ensure_slots(self, size: int) -> _CpuSlots:
        """The CPU slots, made larger where ``size`` needs it."""
        if self.slots is None or len(self.slots.slots) < size:
            self.slots = _CpuSlots(size)
        return self.slots

    def follow_cast(self) -> None:
        """The model was cast after attaching (``model.double()``, ``.half()``, ``.to(dtype)``):
        group the tensors by their new dtypes.

        Raises:
            ModelMoved: a parameter moved to another device; the buffer and the taps' cells live
                on the device the model was on, so that this cannot be followed.
        """
        keys = [None if old is None else group_key(p, self.cpu_fast) for p, old in zip(self.params, self.keys)]
        for old, new in zip(self.keys, keys):
            if old is not None and new[0] != old[0]:
                raise ModelMoved(old[0], new[0])
        log.info("gradwatch: the model's parameters changed dtype after attaching; statistics follow them")
        self.regroup(keys)

    def note_tiers(self, key: tuple, first: int, tiny: TinyStats) -> None:
        """After a CPU group's reduction from column ``first``: its tensors that turned tiny (the
        slots' ``found_tiny``) or grew out of it (``tiny.grown``) change strategy at the next step."""
        if key[2] == TINY:
            moved, tiny.grown = tiny.grown, []
        elif slot_checked(key, self.cpu_fast):
            moved, self.slots.found_tiny = self.slots.found_tiny, []
        else:
            return
        self.retier.update(first + k for k in moved)

    def apply_retier(self) -> None:
        """Move the columns in ``retier`` between the tiny tier and their own strategy."""
        keys = list(self.keys)
        for column in self.retier:
            key = keys[column]
            if key is not None:
                keys[column] = group_key(self.params[column], self.cpu_fast) if key[2] == TINY else (key[0], key[1], TINY)
        self.retier.clear()
        self.regroup(keys)

    def on_cpu_path(self, key: tuple) -> bool:
        """Whether a group of ``key`` takes the CPU's own path (slots, host checks, float64 counted)."""
        return key[0].type == "cpu" and self.cpu_fast

    def drop_references(self) -> None:
        """Forget the parameters (close())."""
        self.params = []
        self.groups = []
        self.light_groups = []
        self.whole_group = None

    def _make_groups(self, keys: list) -> list[Group]:
        groups = []
        for key, cols in _contiguous_groups(keys):
            params = self.params[cols]
            dotted = slot_checked(key, self.cpu_fast) and key[1] == torch.float32
            groups.append(Group(key, cols, params, dots_from(params) if dotted else len(params)))
        return groups


def _contiguous_groups(keys: list) -> list[tuple[tuple | None, slice]]:
    """(key, columns) of each run of equal keys (the columns are sorted by key)."""
    groups: list[tuple[tuple | None, slice]] = []
    start = 0
    for j in range(1, len(keys) + 1):
        if j == len(keys) or keys[j] != keys[start]:
            groups.append((keys[start], slice(start, j)))
            start = j
    return groups


def dots_from(params: list[torch.Tensor]) -> int:
    """Where the trailing run of tensors of at least :data:`DOT_MIN` elements starts (``len(params)``:
    none). ``ParamStats`` orders the columns of each key by that size (:func:`read_by_dot`), so that
    in a group they are its tail."""
    start = len(params)
    while start and params[start - 1].numel() >= DOT_MIN:
        start -= 1
    return start


def read_by_dot(p: torch.Tensor, key: tuple | None) -> bool:
    """Whether a column of ``key`` is read by a dot on the steps that need sums of squares only
    (CPU float32 tensors of at least :data:`DOT_MIN` elements on the CPU's own path)."""
    return key is not None and key[2] is True and p.numel() >= DOT_MIN


def slot_checked(key: tuple | None, cpu_fast: bool) -> bool:
    """Whether a group of ``key`` is reduced into the float32 slots and checked on the host."""
    return cpu_fast and key is not None and key[0].type == "cpu" and key[1] in _SLOT_DTYPES and key[2] != TINY


def group_key(p: torch.Tensor, cpu_fast: bool, dense: bool = False) -> tuple | None:
    """(device, dtype, large CPU float32) of a dense local tensor; None for DTensors (reduced one by one)."""
    if not dense and is_dtensor(p):
        return None
    large = cpu_fast and p.device.type == "cpu" and p.dtype == torch.float32 and p.numel() >= CPU_LARGE
    return (p.device, p.dtype, large)
