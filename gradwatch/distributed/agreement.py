"""The attach agreement: every rank describes the layers it holds, and all agree on one layout."""

from __future__ import annotations

import logging
from typing import Any

from ..capture.layers import LayerSpec
from ..failures import FailureLog
from .collectives import Collectives
from .mesh import MeshLayout, conflicts, describe_rank

log = logging.getLogger("gradwatch")


def agree_on_layout(collectives: Collectives, layers: list[LayerSpec], recorder: Any, output_shares: Any,
                    failures: FailureLog) -> MeshLayout | None:  # fmt: skip
    """One collective at attach (``all_gather_object``); returns the union layout, or None.

    Ranks holding the same layers (data parallelism, FSDP2) keep their own layout: identical by
    construction (None). Ranks holding different layers (pipeline stages) or sharing layer outputs
    (tensor parallelism) reduce into the union of every rank's layers (``mesh.py``). A layer name
    held with different units or parameter shapes on two ranks cannot be combined: reduction is
    turned off and each rank reports its own statistics.
    """
    mine = describe_rank(layers, recorder.param_stats, recorder.layout, output_shares)
    ranks = collectives.gather_objects(mine)
    if ranks is None:
        return None
    mismatched = conflicts(ranks)
    if mismatched:
        collectives.disable()
        log.warning(
            "gradwatch: the same layer name has different units or parameters on different ranks (%s%s), so "
            "statistics cannot be combined across ranks: each rank reports its own and only rank 0 writes. "
            "Give every rank the same model structure and names: for pipeline stages, build the full model "
            "and delete the layers outside each stage (names stay those of the full model); ranks may "
            "monitor different layers, but a name must mean the same layer everywhere.",
            "; ".join(mismatched[:3]), " ..." if len(mismatched) > 3 else "",
        )  # fmt: skip
        return None
    if all(r.signature() == mine.signature() for r in ranks) and output_shares is None:
        return None  # the same layers everywhere: the rank's own layout is the shared one
    try:
        return MeshLayout(ranks, collectives.rank, recorder.layout)
    except Exception as exc:  # the same on every rank (same descriptions): every rank goes local
        collectives.disable()
        failures.failed("agreeing on a layout across ranks", exc, "each rank reports its own statistics")
        return None
