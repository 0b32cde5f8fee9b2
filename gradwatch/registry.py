"""Declared output statistics: one entry is the whole definition of a per-layer statistic of a
layer's output, recorded on the sampled steps (every step with ``detail="full"``).

An entry says what the tap accumulates (traceable tensor ops on the output, into declared
cells), how ranks combine the accumulators (``reduce``) and how a union of ranks weighs them
(``union_weight``: ``"count"`` like the forward sums, each tensor-parallel piece once), how the
host decodes them into a value, and the tag it is written under (``gradwatch/<name>/<layer>``).
The buffer layout (``capture.layout``), the taps (``capture.taps``), the union gather
(``distributed.mesh``), the decoder (``flush.decode``) and the scalars (``sinks.scalars``) read
the entries; adding a statistic of this family is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np
import torch


@dataclass(frozen=True)
class OutputStatistic:
    """One per-layer statistic of each layer's output.

    Args:
        name: the statistic's name: its tag is ``gradwatch/<name>/<layer>``.
        accumulators: names of the per-layer sums it adds up over a step's calls (and ranks).
        accumulate: ``fn(output) -> list of 0-d tensors``, one per accumulator, for one call's
            output (this rank's piece, grad mode off). Runs inside the tap: tensor ops only, so
            that it compiles under ``torch.compile(fullgraph=True)``.
        decode: ``fn(accumulators [..., k]) -> values [...]`` on the host; NaN where undefined.
        reduce: how ranks combine the accumulators ("sum").
        union_weight: how ranks holding pieces of one layer's output weigh them: "count" (like the
            forward sums: split outputs add up, a repeated output counts once).
        description: what the value means, for the docs and ``help()``.
    """

    name: str
    accumulators: tuple[str, ...]
    accumulate: Callable[[torch.Tensor], list[torch.Tensor]]
    decode: Callable[[np.ndarray], np.ndarray]
    reduce: Literal["sum"] = "sum"
    union_weight: Literal["count"] = "count"
    description: str = ""


def _sum_of_squares(out: torch.Tensor) -> list[torch.Tensor]:
    """Sum of squares (float32 at least, so that half-precision squares do not overflow) and count."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return [torch.linalg.vector_norm(out, dtype=acc).square(), _count(out, acc)]


def _zeros(out: torch.Tensor) -> list[torch.Tensor]:
    """Exactly-zero elements and count."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return [(out == 0).sum(dtype=acc), _count(out, acc)]


def _count(out: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    # A tensor op rather than a Python int: traced the same for any (dynamic) shape.
    return torch.ones_like(out, dtype=acc).sum()


def _ratio(accumulators: np.ndarray, root: bool = False) -> np.ndarray:
    total, count = accumulators[..., 0], accumulators[..., 1]
    value = np.where(count > 0, total / np.where(count > 0, count, 1.0), np.nan)
    return np.sqrt(value) if root else value


#: Every declared output statistic, in tag order.
OUTPUT_STATISTICS: tuple[OutputStatistic, ...] = (
    OutputStatistic(
        "act_rms", ("sum of squares", "elements"), _sum_of_squares, lambda a: _ratio(a, root=True),
        description="root-mean-square of the layer's output over every element of the step's calls",
    ),
    OutputStatistic(
        "act_zero_fraction", ("exact zeros", "elements"), _zeros, _ratio,
        description="fraction of the layer's output elements that are exactly zero over the step's calls",
    ),
)


def accumulator_count() -> int:
    """Accumulators per layer and step, over every declared output statistic."""
    return sum(len(s.accumulators) for s in OUTPUT_STATISTICS)


def accumulate_all(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every statistic's accumulators of one output, as one 1-D tensor of ``dtype`` (traceable)."""
    parts = [value for s in OUTPUT_STATISTICS for value in s.accumulate(out)]
    return torch.stack(parts).to(dtype)


def decode_all(accumulators: np.ndarray) -> dict[str, np.ndarray]:
    """[..., accumulator_count()] -> {name: values [...]} for every declared statistic."""
    values, start = {}, 0
    for s in OUTPUT_STATISTICS:
        stop = start + len(s.accumulators)
        with np.errstate(divide="ignore", invalid="ignore"):
            values[s.name] = s.decode(accumulators[..., start:stop])
        start = stop
    return values
