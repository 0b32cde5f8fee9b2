"""The one owner of every collective gradwatch makes, behind one switch.

Nothing else in the package calls ``torch.distributed``: the attach agreement (one
``all_gather_object``), the flush reductions (one ``all_reduce`` per reduction kind of the
statistics buffer) and, under tensor/sequence parallelism, the per-step reduction of a
*private copy* of the ``Partial`` gradients all go through :class:`Collectives`.

Rules, in the manner of torchmetrics' ``Metric`` (which owns its sync behind ``dist_sync_on_step``
and ``sync_on_compute``):

- ``enabled`` is the switch. Off (``sync_dist=False``, a single process, after a failure, after
  an exception on this rank) means no collective at all, also under tensor parallelism.
- ``paused`` (``GradMonitor.pause()``) means no per-step collective either.
- A collective that raises is never retried: with NCCL the communicator is usually gone, or
  the other ranks have moved on, and a retry would meet a different collective of the user's.
  This rank stops reducing, with one WARNING, and reports its own statistics from then on.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("gradwatch")


def world_size() -> int:
    """Processes in the default group (1 without ``torch.distributed``)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 without ``torch.distributed``)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Collectives:
    """Every collective of one monitor, and the switch that turns them all off.

    Args:
        sync_dist: ``None`` (on when more than one process runs), ``True`` or ``False``.
    """

    def __init__(self, sync_dist: bool | None) -> None:
        self.world_size = world_size()
        self.rank = rank()
        self._enabled = self.world_size > 1 if sync_dist is None else (bool(sync_dist) and self.world_size > 1)
        #: set by ``GradMonitor.pause()``: no per-step collective while paused
        self.paused = False
        self._warned = False
        #: number of collectives made, by kind (a test's witness; never reset)
        self.calls: dict[str, int] = {"gather": 0, "reduce": 0, "partials": 0}

    # ----------------------------------------------------------------- switch
    @property
    def enabled(self) -> bool:
        """Whether gradwatch makes collectives at all."""
        return self._enabled

    def enable(self, value: bool) -> None:
        """The user's switch (``GradMonitor.sync_dist = ...``); on only where several processes run."""
        self._enabled = bool(value) and self.world_size > 1

    def disable(self) -> None:
        """No collective from now on (an exception on this rank: the others may not reach one)."""
        self._enabled = False

    def _failed(self, what: str, exc: BaseException) -> None:
        """A collective raised: stop reducing for good, say so once, never retry."""
        self._enabled = False
        if not self._warned:
            self._warned = True
            log.warning(
                "gradwatch: %s failed on this rank (%s: %s); it is not retried, and from now on this rank "
                "makes no collective and reports its own statistics (only rank 0 writes)",
                what, type(exc).__name__, exc,
            )  # fmt: skip

    # ------------------------------------------------------------- collectives
    def gather_objects(self, mine: Any) -> list[Any] | None:
        """Every rank's ``mine`` (one ``all_gather_object``, at attach); None if off or failed."""
        if not self._enabled:
            return None
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        self.calls["gather"] += 1
        try:
            dist.all_gather_object(gathered, mine)
        except Exception as exc:
            self._failed("agreeing on a layout across ranks", exc)
            return None
        return gathered

    def reduce_states(self, spans: list[tuple[str, torch.Tensor]]) -> bool:
        """Reduce each ``(kind, flat tensor)`` in place (one ``all_reduce`` per reduction kind, at a
        flush). Returns whether every span was reduced; False when off or after a failure."""
        if not self._enabled:
            return False
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        for kind, span in spans:
            self.calls["reduce"] += 1
            try:
                dist.all_reduce(span, op=ops[kind])
            except Exception as exc:
                self._failed("the cross-process reduction of gradwatch's statistics", exc)
                return False
        return True

    def reduce_partials(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """A private, reduced copy of the local pieces of ``Partial(sum)`` DTensor gradients.

        One ``all_reduce`` per (mesh, Partial mesh dims, dtype) over all of them, on a new flat
        tensor: the gradients themselves are never touched. Returns one local tensor per gradient
        (the reduced piece, a view into the private copy), or None where no collective may be
        made now (off, paused, failed): the caller then reads the local pending sums.
        """
        if not self._enabled or self.paused or not grads:
            return None
        batches: dict[tuple, list[int]] = {}
        for i, g in enumerate(grads):
            dims = tuple((d, getattr(pl, "reduce_op", "sum")) for d, pl in enumerate(g.placements) if pl.is_partial())
            batches.setdefault((id(g.device_mesh), dims, g.dtype), []).append(i)
        reduced: list[torch.Tensor | None] = [None] * len(grads)
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        for (_, dims, _), members in batches.items():
            pieces = [grads[i].to_local() for i in members]
            flat = torch.cat([piece.reshape(-1) for piece in pieces])  # a copy: gradients stay as they are
            mesh = grads[members[0]].device_mesh
            for dim, op in dims:
                self.calls["partials"] += 1
                try:
                    dist.all_reduce(flat, op=ops[op], group=mesh.get_group(dim))
                except Exception as exc:
                    self._failed("the per-step reduction of Partial gradients (tensor parallelism)", exc)
                    return None
                if op == "avg":
                    flat.div_(mesh.size(dim))
            offset = 0
            for i, piece in zip(members, pieces):
                reduced[i] = flat[offset : offset + piece.numel()].view(piece.shape)
                offset += piece.numel()
        return reduced  # type: ignore[return-value]

