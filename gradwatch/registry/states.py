"""Every state of the statistics buffer, declared once: shape, reduction across ranks, and how a
rank's values enter the union of a model split over ranks (``distributed/mesh.py``).

A state's ``dims`` are symbolic sizes, resolved when the monitor attaches (:class:`Sizes`), so the
declarations depend only on the model's structure and ``flush_every``: the same on every rank.
``capture/layout.py`` declares a rank's own buffer from this table, ``distributed/mesh.py`` the
union's and its gather; the recorder, the read-back and the decoder address states by these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..capture.buffer import Reduce, StatBuffer
from .outputs import accumulator_count

Dim = Literal["step", "update_step", "param", "layer", "unit", "sample", "accumulator", "out_grad_parts"]
#: Which union index a state's values are placed by: its parameter columns, its layers, its units,
#: its update-sample columns; None: copied whole (a per-step flag of the rank's own).
UnionIndex = Literal["param", "layer", "unit", "sample"] | None
#: How a rank's values are weighted in the union before the world-wide reduction:
#: "column": a plain tensor held by h ranks weighs 1/h, a DTensor piece pieces/h (sharding.py);
#: "output": a layer's output-gradient block [sum of squares, calls, samples] by its output and
#: count weights (tensor_parallel.py); "count": the count weight (split outputs add up, repeated
#: ones count once); "unit": each unit's output weight; "sample": 1/h; "stage": the forward clock
#: lifted by the stage's position (the order runs across stages); None: unweighted.
UnionWeight = Literal["column", "output", "count", "unit", "sample", "stage"] | None


@dataclass(frozen=True)
class StateDecl:
    """One state of the buffer.

    Args:
        name: the state's name (``buffer[name]``).
        dims: its shape, in symbolic sizes (an ``int`` for a fixed one).
        reduce: how ranks combine it: "sum" or "max".
        replicated: identical on every data-parallel rank of a rank's own layout (parameter
            gradients after the all-reduce, the update sample), so not reduced there ("none"):
            "unless_sharded" (reduced when the parameters are DTensor pieces), "always", or False.
        host: a count the host knows (numpy, copied in at flush) in a rank's own buffer; the
            union holds it on the device like the rest.
        union_index: the dimension a rank's values are placed by in the union's (see ``UnionIndex``).
        union_weight: how they are weighted there (see ``UnionWeight``).
        needs: declared only with an optimizer ("updates") or with output statistics ("accumulators").
        description: what it holds.
    """

    name: str
    dims: tuple[Dim | int, ...]
    reduce: Literal["sum", "max"]
    replicated: Literal["unless_sharded", "always", False] = False
    host: bool = False
    union_index: UnionIndex = None
    union_weight: UnionWeight = None
    needs: Literal["updates", "accumulators"] | None = None
    description: str = ""


PARAM_SQ = "param_sq"
PARAM_MAX = "param_max"
PARAM_NONFINITE = "param_nonfinite"
PARAM_PRESENT = "param_present"
OUT_GRAD = "out_grad"
FWD_SUM = "fwd_sum"
FWD_ORDER = "fwd_order"
OUT_STATS = "out_stats"
STEP_FAILED = "step_failed"
STEP_UNSAMPLED = "step_unsampled"
UNIT_ACC = "unit_acc"
DEAD_SUSPECTED = "dead_suspected"
UPDATE_SQ = "update_sq"
WEIGHT_SQ = "weight_sq"
UPDATE_SEEN = "update_seen"
SAMPLE_UPDATE_SQ = "sample_update_sq"
SAMPLE_WEIGHT_SQ = "sample_weight_sq"

#: Every state, in storage order within its reduction kind. Per-step states have one row per step
#: of the window; the update states one per measured optimizer step (at most flush_every + 1: a
#: measurement after a window's last step joins the next one).
STATES: tuple[StateDecl, ...] = (
    StateDecl(PARAM_SQ, ("step", "param"), "sum", "unless_sharded", union_index="param", union_weight="column",
              description="per tensor: the sum of squares of its gradient"),
    StateDecl(PARAM_MAX, ("step", "param"), "max", "unless_sharded", union_index="param",
              description="per tensor: max |g| (sampled steps)"),
    StateDecl(PARAM_NONFINITE, ("step", "param"), "sum", "unless_sharded", union_index="param",
              union_weight="column", description="per tensor: NaN/Inf elements of its gradient"),
    StateDecl(PARAM_PRESENT, ("step", "param"), "sum", "unless_sharded", host=True, union_index="param",
              description="per tensor: ranks on which it had a gradient"),
    # Output gradients and forward outputs differ per rank: combined by sum, like micro-batches.
    StateDecl(OUT_GRAD, ("step", "out_grad_parts", "layer"), "sum", union_index="layer", union_weight="output",
              description="per layer: sum of squares of its output gradients, their calls, and the samples "
                          "(batch rows) behind its dead-unit evidence"),
    StateDecl(FWD_SUM, ("step", "layer"), "sum", union_index="layer", union_weight="count",
              description="per layer: the sum of its outputs (non-finite at a step whose outputs were)"),
    StateDecl(FWD_ORDER, ("step", "layer"), "max", union_index="layer", union_weight="stage",
              description="per layer: the forward clock at its first call (0: not recorded)"),
    StateDecl(OUT_STATS, ("step", "layer", "accumulator"), "sum", union_index="layer", union_weight="count",
              needs="accumulators", description="per layer: the output statistics' accumulators (outputs.py)"),
    StateDecl(STEP_FAILED, ("step",), "sum", host=True, description="ranks on which recording the step failed"),
    # Ranks may sample different steps (each confirms dead units from its own evidence mid-window):
    # a step is sampled in the reduced window only where every rank sampled it.
    StateDecl(STEP_UNSAMPLED, ("step",), "sum", host=True,
              description="ranks on which the step was not sampled (recorded the per-step statistics only)"),
    StateDecl(UNIT_ACC, ("unit",), "sum", union_index="unit", union_weight="unit",
              description="per unit, over the window: zero exactly for dead units"),
    # Each rank asks for a mid-window confirmation from its own rows; the rule's back-off must
    # follow what the ranks asked together, or their schedules (and their sampled steps) drift apart.
    StateDecl(DEAD_SUSPECTED, ("layer",), "sum", host=True, union_index="layer",
              description="per layer, over the window: ranks that recorded the rest of the window in full to "
                          "confirm its dead units"),
    StateDecl(UPDATE_SQ, ("update_step", "param"), "sum", "unless_sharded", union_index="param",
              union_weight="column", needs="updates", description="per tensor: ||w_after - w_before||^2"),
    StateDecl(WEIGHT_SQ, ("update_step", "param"), "sum", "unless_sharded", union_index="param",
              union_weight="column", needs="updates", description="per tensor: ||w_before||^2"),
    StateDecl(UPDATE_SEEN, ("update_step", "param"), "sum", "unless_sharded", host=True, union_index="param",
              needs="updates", description="per tensor: ranks on which it was measured"),
    # The per-step estimate: the same squared norms of a fixed sample (16 runs of 64 elements) of each weight matrix
    # (updates.sample_view) at every optimizer step; sharded tensors are not sampled.
    StateDecl(SAMPLE_UPDATE_SQ, ("step", "sample"), "sum", "always", union_index="sample", union_weight="sample",
              needs="updates", description="per sampled matrix: ||sample after - before||^2"),
    StateDecl(SAMPLE_WEIGHT_SQ, ("step", "sample"), "sum", "always", union_index="sample", union_weight="sample",
              needs="updates", description="per sampled matrix: ||sample before||^2"),
)


@dataclass(frozen=True)
class Sizes:
    """The symbolic sizes of one layout."""

    flush_every: int
    params: int
    layers: int
    units: int
    samples: int
    track_updates: bool

    def resolve(self, dims: tuple[Dim | int, ...]) -> tuple[int, ...]:
        """``dims`` as a shape."""
        size = {"step": self.flush_every, "update_step": self.flush_every + 1, "param": self.params,
                "layer": self.layers, "unit": self.units, "sample": self.samples,
                "accumulator": accumulator_count(), "out_grad_parts": 3}  # fmt: skip
        return tuple(d if isinstance(d, int) else size[d] for d in dims)

    def declares(self, state: StateDecl) -> bool:
        """Whether the layout has ``state``."""
        return (state.needs is None or (state.needs == "updates" and self.track_updates)
                or (state.needs == "accumulators" and accumulator_count() > 0))  # fmt: skip


def declared(sizes: Sizes) -> list[StateDecl]:
    """The states a layout of these sizes has, in storage order."""
    return [s for s in STATES if sizes.declares(s)]


def declare_states(buffer: StatBuffer, sizes: Sizes, *, union: bool, sharded: bool) -> None:
    """Declare every state on ``buffer`` and freeze it.

    Args:
        buffer: an empty buffer.
        sizes: the layout's sizes.
        union: the union of several ranks' layers (``mesh.py``): every state reduced, host
            counts held on the device (copied there from a rank's own buffer).
        sharded: a rank's own layout whose parameters are DTensor pieces (partial sums and maxima).
    """
    for state in declared(sizes):
        reduce: Reduce = state.reduce
        if not union and (state.replicated == "always" or (state.replicated == "unless_sharded" and not sharded)):
            reduce = "none"
        buffer.add_state(state.name, sizes.resolve(state.dims), reduce, host=state.host and not union)
    buffer.freeze()
