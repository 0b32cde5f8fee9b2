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
from typing import Callable

import numpy as np
import torch

from .column_groups import TINY, ColumnGroups, Group, group_key, read_by_dot
from .layers import LayerSpec, rank_gradient
from .reductions import CpuBlasStats, ForeachStats, StepRows, TinyStats, complex_stats
from .sharded_sums import ShardedSums
from ..distributed.sharding import is_dtensor, local_piece, piece_weight

log = logging.getLogger("gradwatch")

_is_none = functools.partial(operator.is_, None)

#: The CPU's own path (float32 results in host-shared slots, checked on the host, and
#: CpuBlasStats for large tensors). False: CPU tensors take the device-agnostic path that
#: accelerators take (float64 foreach norms, counts on sampled steps), which is how the
#: test suite runs that path on every commit without a GPU. Read when a monitor attaches.
CPU_FAST_PATH = True


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
        #: after ``record``: the step's sum of squares over every parameter gradient, where one check on
        #: the host found them all present, finite and not tiny (the CPU's whole-group path); else None
        self.checked_total: float | None = None
        # Columns ordered by group (device, dtype, strategy): each group a contiguous slice.
        # reduced one by one: sparse-capable tensors, and gradients kept elsewhere (read through ``_grad``)
        keys = [None if id(p) in c.sparse_capable or id(p) in readers else group_key(p, self.cpu_fast) for p in params]
        # (within a key, the tensors read by a dot last: the tail of a group, ``ColumnGroups``)
        order = sorted(range(len(params)),
                       key=lambda j: (keys[j] is None, str(keys[j]), read_by_dot(params[j], keys[j]), j))  # fmt: skip
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
        dense_whole = not self.sharded and not self._world.dtensors and not self._readers
        #: the columns' groups by strategy, and their moves between tiers (``column_groups.py``)
        self.columns = ColumnGroups(self.params, [keys[j] for j in order], self.cpu_fast, dense_whole)

    @property
    def n_params(self) -> int:
        return len(self.params)

    def strategy_of(self, column: int) -> str:
        """The name of the strategy that reduces column ``column`` when its gradient is dense."""
        for group in self.columns.groups:
            if group.cols.start <= column < group.cols.stop:
                large = group.key[2] if group.key is not None else False
                return self._tiny.name if large == TINY else self._blas.name if large else self._foreach.name
        raise IndexError(column)

    def record(self, rows: StepRows, present: np.ndarray) -> bool:
        """Write this step's per-tensor partials into ``rows``; set ``present`` to 1 where a gradient
        was. Returns whether ``rows.sq`` holds norms rather than sums of squares (only where
        ``rows.norms_allowed``, in the common case: ``ForeachStats.reduce``)."""
        self.checked_total = None
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # gradients made with create_graph=True require grad themselves
        try:
            return self._record(rows, present)
        finally:
            torch._C._set_grad_enabled(grad_mode)

    def _record_whole(self, group: Group, rows: StepRows, present: np.ndarray) -> bool | None:
        """``_record`` for the common case (``ColumnGroups.whole_group``; with max |g| off the CPU's own path):
        the same reduction, called directly; returns whether it left norms (see ``record``). None,
        having written nothing it keeps, where the general path must decide (a gradient missing, a
        cast after attaching, a reduction that raised)."""
        params, columns = group.params, self.columns
        grads = [p.grad for p in params]
        if any(map(_is_none, grads)) or params[0].dtype != group.key[1]:
            return None
        try:
            slots = columns.slots if columns.whole_slots else None
            norms = self._foreach.reduce(grads, rows, slots, keep_norms=True, dots_from=group.dots_from)
        except Exception:
            return None  # the general path reduces each tensor alone and names the one that fails
        present.fill(1)
        if columns.whole_slots:
            if columns.slots.found_tiny:
                columns.note_tiers(group.key, 0, self._tiny)
            self.checked_total = columns.slots.checked_total
        return norms

    def _record(self, rows: StepRows, present: np.ndarray) -> bool:
        # Every Python operation here runs right after backward has evicted the interpreter's
        # working set from the caches, at ~10x its usual price: the common case is kept short.
        weights: list[tuple[int, float]] = []
        columns = self.columns
        if columns.retier:
            columns.apply_retier()
        whole = columns.whole_group
        # max |g| (sampled steps) on the CPU's own path takes the general loop: its large tensors
        # have a faster max of their own there (``CpuBlasStats``); elsewhere one foreach kernel does
        if whole is not None and (rows.max is None or not columns.whole_slots):
            norms = self._record_whole(whole, rows, present)
            if norms is not None:
                return norms
        private = self._world.reduced_partials()
        for group in columns.groups if rows.max is not None else columns.light_groups:
            key = group.key
            if key is not None and (group.params[0].dtype != key[1] or group.params[0].device != key[0]):
                columns.follow_cast()  # cast after attaching: follow it (or, moved, say so)
                return self._record(rows, present)
            grads = [p.grad for p in group.params] if group.key is not None or not self._readers else \
                [self._grad(p) for p in group.params]
            if group.key is not None and not any(map(_is_none, grads)):
                present[group.cols] = 1
                for k in self._reduce(group.key, grads, rows.part(group.cols), group.cols.start, group.dots_from):
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
                if self._reduce(group_key(g, self.cpu_fast, dense=True), [g], rows.part(slice(column, column + 1))):
                    present[column] = 0
        if self.sharded:
            self._world.apply(rows, weights)
        return False

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """A parameter's gradient as this rank holds it: ``p.grad``, or its piece where it is kept
        elsewhere (ZeRO's buffers, FSDP1's flat gradient)."""
        return rank_gradient(p, self._readers.get(id(p)))

    def _reduce(self, key: tuple, grads: list[torch.Tensor], rows: StepRows, first: int | None = None,
                dots_from: int | None = None) -> list[int]:  # fmt: skip
        """One group's reduction; if it raises, each tensor alone, so that a tensor that cannot be
        reduced costs its own statistics only (left out as if it had no gradient, one warning naming
        it), never its group's. Returns the positions of the tensors left out. ``first``: the
        group's first column, to move tensors whose squares underflow (None: tensors reduced one by
        one, whose tier is not followed); ``dots_from``: the group's (``Group.dots_from``)."""
        try:
            self._reduce_group(key, grads, rows, dots_from)
            if first is not None:
                self.columns.note_tiers(key, first, self._tiny)
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

    def _reduce_group(self, key: tuple, grads: list[torch.Tensor], rows: StepRows,
                      dots_from: int | None = None) -> None:  # fmt: skip
        device, dtype, large = key
        if large == TINY:
            self._tiny.reduce(grads, rows)
            return
        if dtype.is_complex:  # measured by their modulus: sum of |g|^2, max |g|, non-finite elements
            complex_stats(grads, rows, self._foreach.acc_dtype)
            return
        on_cpu = self.columns.on_cpu_path(key)
        if on_cpu and dtype == torch.float64:  # float32 slots cannot hold them: float64 norms, counted
            self._foreach.reduce(grads, rows, None, count=True)
            return
        slots = self.columns.ensure_slots(len(grads)) if on_cpu else None
        if large:
            self._blas.reduce(grads, rows, slots)  # type: ignore[arg-type]
        else:
            self._foreach.reduce(grads, rows, slots, dots_from=dots_from)

    def param_weights(self) -> np.ndarray:
        """Each column's weight in a world-wide sum of its parameter's pieces (``ShardedSums.param_weights``)."""
        return self._world.param_weights(self.params)

    def drop_references(self) -> None:
        """Forget the parameters (close())."""
        self.params = []
        self._world.drop_references()
        self._readers = {}
        self.columns.drop_references()
