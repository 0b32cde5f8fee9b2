"""Per-tensor statistics of the parameter gradients, as they stand at step().

In the manner of ``torch.nn.utils.clip_grad``: gradients are grouped by device,
dtype and strategy, and each group is reduced by one strategy of ``reductions.py``
that fills every statistic of its tensors. Results are per *tensor*, written into
the step's row of the per-tensor states (``param_sq``, ``param_max``,
``param_nonfinite``); the host adds them up per layer at flush. Columns are ordered
by group at attach, so that each group writes one contiguous slice with
``torch.stack(..., out=)``; regrouping (a cast, tensors that turn tiny) keeps that
order and only splits or joins the runs.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .layers import LayerSpec, rank_gradient
from .reductions import (  # noqa: F401  (StepRows, nonfinite_counts: their import path before the split)
    CpuBlasStats, ForeachStats, StepRows, TinyStats, _CpuSlots, complex_stats, nonfinite_counts,
)
from .sharded_sums import ShardedSums
from ..distributed.sharding import is_dtensor, local_piece, piece_weight

log = logging.getLogger("gradwatch")

_is_none = functools.partial(operator.is_, None)

# CPU float32 tensors at least this large go to CpuBlasStats; smaller ones (biases,
# norms) to one foreach call per group, which saves a Python dispatch per tensor.
CPU_LARGE = 1 << 15

#: The CPU's own path (float32 results in host-shared slots, checked on the host, and
#: CpuBlasStats for large tensors). False: CPU tensors take the device-agnostic path that
#: accelerators take (float64 foreach norms, counts on sampled steps), which is how the
#: test suite runs that path on every commit without a GPU. Read when a monitor attaches.
CPU_FAST_PATH = True

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
class _Group:
    """Parameters reduced together: one strategy, one contiguous slice of columns."""

    key: tuple | None  # (device, dtype, large CPU float32); None: reduced one by one (DTensors, sparse)
    cols: slice
    params: list[torch.nn.Parameter]


class _Columns:
    """The layers' parameters as columns, in layer order, with what each needs said about it."""

    def __init__(self, layers: list[LayerSpec]) -> None:
        self.params: list[torch.nn.Parameter] = []
        self.owner: list[int] = []  # the layer of each column
        self.names: list[str] = []  # "layer.parameter" (log lines only)
        self.shapes: list[tuple[int, ...]] = []  # whole shapes (FSDP1 pieces: the parameter's)
        self.pieces: list[int] = []  # FSDP1 / ZeRO pieces of the gradient over the ranks (0: whole)
        self.sparse_capable: set[int] = set()  # Embedding(sparse=True): reduced one by one
        #: id(parameter) -> how to read its gradient where it is not ``p.grad`` (DeepSpeed ZeRO's
        #: buffers, FSDP1's flat gradient: ``LayerSpec.grad_readers``)
        self.readers: dict[int, Callable[[torch.Tensor], torch.Tensor | None]] = {}
        #: parameters whole on this rank whose gradient is partitioned (ZeRO 1/2; not ZeRO 3, FSDP1)
        self.whole_ids: set[int] = set()
        for index, layer in enumerate(layers):
            may_be_sparse = bool(getattr(layer.module, "sparse", False))
            for p, name, shape, count, reader, whole_here in zip(layer.params, layer.param_names, layer.shapes,
                                                                 layer.pieces, layer.grad_readers,
                                                                 layer.whole_on_rank):  # fmt: skip
                self.params.append(p)
                self.names.append(f"{layer.name}.{name}")
                self.owner.append(index)
                self.shapes.append(shape)
                self.pieces.append(count)
                if may_be_sparse:
                    self.sparse_capable.add(id(p))
                if reader is not None:
                    self.readers[id(p)] = reader
                if whole_here:
                    self.whole_ids.add(id(p))


class ParamStats:
    """Per-tensor sum of squares, max |g| and non-finite count of the layers' parameter gradients."""

    def __init__(
        self,
        layers: list[LayerSpec],
        device: torch.device,
        world_size: int = 1,
        reduce_partials: Callable[[list[torch.Tensor]], list[torch.Tensor] | None] | None = None,
    ) -> None:
        c = _Columns(layers)
        params, owner, names, shapes, pieces, readers = c.params, c.owner, c.names, c.shapes, c.pieces, c.readers
        self.n_layers, self.world_size = len(layers), max(int(world_size), 1)
        #: FSDP1 pieces (``_compat.fsdp1``), ZeRO fragments or DTensors: partial sums combined over the ranks
        self.sharded = any(is_dtensor(p) for p in params) or any(pieces)
        self._readers = readers
        self.device = device
        self.cpu_fast = CPU_FAST_PATH
        #: Non-finite elements are counted at every step (the CPU path's host check), not only on
        #: sampled steps.
        self.counts_every_step = self.cpu_fast and all(p.device.type == "cpu" for p in params)
        self._foreach = ForeachStats(torch.float32 if device.type == "mps" else torch.float64)
        self._blas = CpuBlasStats()
        self._tiny = TinyStats()
        #: columns to move into or out of TinyStats at the next step (their squares underflow float32)
        self._retier: set[int] = set()
        # Columns ordered by group (device, dtype, strategy): each group a contiguous slice.
        # reduced one by one: sparse-capable tensors, and gradients kept elsewhere (read through ``_grad``)
        keys = [None if id(p) in c.sparse_capable or id(p) in readers else _group_key(p, self.cpu_fast) for p in params]
        order = sorted(range(len(params)), key=lambda j: (keys[j] is None, str(keys[j]), j))
        self.params = [params[j] for j in order]
        #: "layer.parameter" of each column (log lines only)
        self.param_names = [names[j] for j in order]
        self.failed_tensors: set[str] = set()
        self.param_layer = np.array([owner[j] for j in order], dtype=np.int64)
        #: each column's whole tensor: its number of elements and dimensions (not this rank's piece)
        self.numel = np.array([int(np.prod(shapes[j])) if shapes[j] else 1 for j in order], dtype=np.int64)
        self.ndim = np.array([len(shapes[j]) for j in order], dtype=np.int64)
        #: the columns' weights in a world-wide sum, and the Partial gradients' private reductions
        self._world = ShardedSums(self.params, [pieces[j] for j in order], c.whole_ids, self.world_size,
                                  reduce_partials)  # fmt: skip
        self._plan([keys[j] for j in order])

    def _plan(self, keys: list) -> None:
        """Group the columns (in their fixed order) by key: contiguous runs of equal keys."""
        self._keys = keys
        self._groups = self._make_groups(keys)
        # Steps without max |g| (detail="standard", unsampled) need sums of squares only: one
        # foreach kernel per (device, dtype), large CPU tensors included (one op instead of a
        # view and a dot per tensor; foreach_norm reads a cold tensor about as fast).
        self._light_groups = self._make_groups([None if k is None else (k[0], k[1], k[2] == TINY and TINY) for k in keys])
        cpu_sizes = [g.cols.stop - g.cols.start for g in self._groups if g.key is not None and g.key[0].type == "cpu"]
        needed = max(cpu_sizes + [len(g.params) for g in self._light_groups if _slot_checked(g.key, self.cpu_fast)],
                     default=0)  # fmt: skip
        # Slots large enough are kept: a vanishing model re-plans as its tensors cross the tiny
        # line one after another, and new slots cost ~3 ms per re-plan at 500 tensors (unbind).
        if getattr(self, "_slots", None) is None or len(self._slots.slots) < needed:
            self._slots = _CpuSlots(needed)
        # The common case, reduced without the general loop's layers (``_record_whole``): one group of
        # every column, dense and whole on this rank, reduced by ``ForeachStats`` (into the float32
        # slots on the CPU's own path). Each Python call there runs right after backward at ~10x its
        # warm price (benchmarks/RESULTS.md, twenty-fifth session).
        light = self._light_groups
        key = light[0].key if len(light) == 1 else None
        dense_whole = key is not None and not self.sharded and not self._world.dtensors and not self._readers
        simple = dense_whole and key[2] != TINY and not key[1].is_complex and (
            _slot_checked(key, self.cpu_fast) or not self._on_cpu_path(key))  # (CPU float64: counted, elsewhere)
        self._whole_group = light[0] if simple else None
        self._whole_slots = simple and _slot_checked(key, self.cpu_fast)

    def _replan(self) -> None:
        """The model was cast after attaching (``model.double()``, ``.half()``, ``.to(dtype)``):
        group the tensors by their new dtypes. A device move cannot be followed: the buffer and
        the taps' cells live on the device the model was on (:class:`ModelMoved`)."""
        keys = [None if old is None else _group_key(p, self.cpu_fast) for p, old in zip(self.params, self._keys)]
        for old, new, p in zip(self._keys, keys, self.params):
            if old is not None and new[0] != old[0]:
                raise ModelMoved(old[0], new[0])
        log.info("gradwatch: the model's parameters changed dtype after attaching; statistics follow them")
        self._plan(keys)

    def _make_groups(self, keys: list) -> list[_Group]:
        return [_Group(key, cols, self.params[cols]) for key, cols in _contiguous_groups(keys)]

    @property
    def n_params(self) -> int:
        return len(self.params)

    def strategy_of(self, column: int) -> str:
        """The name of the strategy that reduces column ``column`` when its gradient is dense."""
        for group in self._groups:
            if group.cols.start <= column < group.cols.stop:
                large = group.key[2] if group.key is not None else False
                return self._tiny.name if large == TINY else self._blas.name if large else self._foreach.name
        raise IndexError(column)

    def record(self, rows: StepRows, present: np.ndarray) -> bool:
        """Write this step's per-tensor partials into ``rows``; set ``present`` to 1 where a gradient
        was. Returns whether ``rows.sq`` holds norms rather than sums of squares (only where
        ``rows.norms_allowed``, in the common case: ``ForeachStats.reduce``)."""
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # gradients made with create_graph=True require grad themselves
        try:
            return self._record(rows, present)
        finally:
            torch._C._set_grad_enabled(grad_mode)

    def _record_whole(self, group: _Group, rows: StepRows, present: np.ndarray) -> bool | None:
        """``_record`` for the common case (``_plan``'s ``_whole_group``) on a step without max |g|:
        the same reduction, called directly; returns whether it left norms (see ``record``). None,
        having written nothing it keeps, where the general path must decide (a gradient missing, a
        cast after attaching, a reduction that raised)."""
        params = group.params
        grads = [p.grad for p in params]
        if any(map(_is_none, grads)) or params[0].dtype != group.key[1]:
            return None
        try:
            norms = self._foreach.reduce(grads, rows, self._slots if self._whole_slots else None, keep_norms=True)
        except Exception:
            return None  # the general path reduces each tensor alone and names the one that fails
        present.fill(1)
        if self._whole_slots and self._slots.found_tiny:
            self._note_tiers(group.key, 0)
        return norms

    def _record(self, rows: StepRows, present: np.ndarray) -> bool:
        # Every Python operation here runs right after backward has evicted the interpreter's
        # working set from the caches, at ~10x its usual price: the common case is kept short.
        weights: list[tuple[int, float]] = []
        if self._retier:
            self._apply_retier()
        whole = self._whole_group
        if whole is not None and rows.max is None:
            norms = self._record_whole(whole, rows, present)
            if norms is not None:
                return norms
        private = self._world.reduced_partials()
        for group in self._groups if rows.max is not None else self._light_groups:
            key = group.key
            if key is not None and (group.params[0].dtype != key[1] or group.params[0].device != key[0]):
                self._replan()  # cast after attaching: follow it (or, moved, say so)
                return self._record(rows, present)
            grads = [p.grad for p in group.params] if group.key is not None or not self._readers else \
                [self._grad(p) for p in group.params]
            if group.key is not None and not any(map(_is_none, grads)):
                present[group.cols] = 1
                for k in self._reduce(group.key, grads, rows.part(group.cols), group.cols.start):
                    present[group.cols.start + k] = 0
                continue
            # Some gradients missing, sparse or sharded: reduce those present one by one.
            for offset, g in enumerate(grads):
                if g is None:
                    continue
                column = group.cols.start + offset
                if is_dtensor(g):
                    reduced = private.get(id(g))
                    g, weight = (reduced, piece_weight(g, self.world_size)) if reduced is not None else local_piece(g, self.world_size)
                    weights.append((column, weight))
                if g.is_sparse:
                    g = g.coalesce()._values()
                present[column] = 1
                if g.numel() == 0:
                    continue
                if self._reduce(_group_key(g, self.cpu_fast, dense=True), [g], rows.part(slice(column, column + 1))):
                    present[column] = 0
        if self.sharded:
            self._world.apply(rows, weights)
        return False

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """A parameter's gradient as this rank holds it: ``p.grad``, or its piece where it is kept
        elsewhere (ZeRO's buffers, FSDP1's flat gradient)."""
        return rank_gradient(p, self._readers.get(id(p)))

    def _reduce(self, key: tuple, grads: list[torch.Tensor], rows: StepRows, first: int | None = None) -> list[int]:
        """One group's reduction; if it raises, each tensor alone, so that a tensor that cannot be
        reduced costs its own statistics only (left out as if it had no gradient, one warning naming
        it), never its group's. Returns the positions of the tensors left out. ``first``: the
        group's first column, to move tensors whose squares underflow (None: tensors reduced one by
        one, whose tier is not followed)."""
        try:
            self._reduce_group(key, grads, rows)
            if first is not None:
                self._note_tiers(key, first)
            return []
        except Exception as exc:
            if len(grads) == 1:
                self._failed_tensor(grads[0], exc)
                return [0]
        failed = []
        for k, g in enumerate(grads):
            try:
                self._reduce_group(key, [g], rows.part(slice(k, k + 1)))
            except Exception as exc:
                self._failed_tensor(g, exc)
                failed.append(k)
        return failed

    def _failed_tensor(self, grad: torch.Tensor, exc: BaseException) -> None:
        name = next((n for p, n in zip(self.params, self.param_names) if p.grad is grad), "?")
        if name not in self.failed_tensors:
            self.failed_tensors.add(name)
            log.warning("gradwatch: the statistics of parameter %s failed (%s: %s); it alone is left out, "
                        "training and the other statistics go on", name, type(exc).__name__, exc)  # fmt: skip

    def _note_tiers(self, key: tuple, first: int) -> None:
        """After a CPU group's reduction: its tensors that turned tiny (or grew out of it) change
        strategy at the next step."""
        if key[2] == TINY:
            moved, self._tiny.grown = self._tiny.grown, []
        elif key[0].type == "cpu" and self.cpu_fast and key[1] in _SLOT_DTYPES:  # the groups the slots check
            moved, self._slots.found_tiny = self._slots.found_tiny, []
        else:
            return
        self._retier.update(first + k for k in moved)

    def _apply_retier(self) -> None:
        """Move the columns in ``_retier`` between TinyStats and their own strategy (the column
        order stays: only the runs of equal keys split or join)."""
        keys = list(self._keys)
        for column in self._retier:
            key = keys[column]
            if key is not None:
                keys[column] = _group_key(self.params[column], self.cpu_fast) if key[2] == TINY else (key[0], key[1], TINY)
        self._retier.clear()
        self._plan(keys)

    def _on_cpu_path(self, key: tuple) -> bool:
        """Whether a group of ``key`` takes the CPU's own path (slots, host checks, float64 counted)."""
        return key[0].type == "cpu" and self.cpu_fast

    def _reduce_group(self, key: tuple, grads: list[torch.Tensor], rows: StepRows) -> None:
        device, dtype, large = key
        if large == TINY:
            self._tiny.reduce(grads, rows)
            return
        if dtype.is_complex:  # measured by their modulus: sum of |g|^2, max |g|, non-finite elements
            complex_stats(grads, rows, self._foreach.acc_dtype)
            return
        on_cpu = self._on_cpu_path(key)
        if on_cpu and dtype == torch.float64:  # float32 slots cannot hold them: float64 norms, counted
            self._foreach.reduce(grads, rows, None, count=True)
            return
        slots = self._slots if on_cpu else None
        if on_cpu and len(grads) > len(self._slots.slots):
            self._slots = slots = _CpuSlots(len(grads))
        if large:
            self._blas.reduce(grads, rows, slots)  # type: ignore[arg-type]
        else:
            self._foreach.reduce(grads, rows, slots)

    def param_weights(self) -> np.ndarray:
        """Each column's weight in a world-wide sum of its parameter's pieces (``ShardedSums.param_weights``)."""
        return self._world.param_weights(self.params)

    def drop_references(self) -> None:
        """Forget the parameters (close())."""
        self.params = []
        self._world.drop_references()
        self._readers = {}
        self._groups = []
        self._light_groups = []
        self._whole_group = None


def _contiguous_groups(keys: list) -> list[tuple[tuple | None, slice]]:
    """(key, columns) of each run of equal keys (the columns are sorted by key)."""
    groups: list[tuple[tuple | None, slice]] = []
    start = 0
    for j in range(1, len(keys) + 1):
        if j == len(keys) or keys[j] != keys[start]:
            groups.append((keys[start], slice(start, j)))
            start = j
    return groups


def _slot_checked(key: tuple | None, cpu_fast: bool) -> bool:
    """Whether a group of ``key`` is reduced into the float32 slots and checked on the host."""
    return cpu_fast and key is not None and key[0].type == "cpu" and key[1] in _SLOT_DTYPES and key[2] != TINY


def _group_key(p: torch.Tensor, cpu_fast: bool, dense: bool = False) -> tuple | None:
    """(device, dtype, large CPU float32) of a dense local tensor; None for DTensors (reduced one by one)."""
    if not dense and is_dtensor(p):
        return None
    large = cpu_fast and p.device.type == "cpu" and p.dtype == torch.float32 and p.numel() >= CPU_LARGE
    return (p.device, p.dtype, large)
