"""The output statistics: one entry is the whole definition of a per-layer statistic of a
layer's output, recorded on the sampled steps (every step with ``detail="full"``).

An entry says what the tap accumulates (traceable tensor ops on the output, into declared
cells; every entry also gets the number of output elements, counted once for all of them), how
the host decodes them into a value, and the tag it is written under (``gradwatch/<name>/<layer>``).
The accumulators live in one state, ``out_stats`` (``states.py``): summed over ranks, weighed in a
union like the forward sums ("count": split outputs add up, a repeated output counts once). The
taps (``capture.taps``) and the decoder (``statistics.py``) read the entries; adding a statistic
of this family is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..capture import cpu_rows


@dataclass(frozen=True)
class OutputStatistic:
    """One per-layer statistic of each layer's output.

    Args:
        name: the statistic's name: its tag is ``gradwatch/<name>/<layer>``.
        accumulators: names of the per-layer sums it adds up over a step's calls (and ranks).
        accumulate: ``fn(output, dtype, exact) -> list of 0-d tensors of dtype`` (the cells' dtype:
            float64, float32 on MPS), one per accumulator, for one call's output (this rank's
            piece, grad mode off). ``exact`` False: the layer's outputs were far from float32's
            underflow and overflow in the last window (:func:`float32_is_exact`), so a sum may be
            reduced in the output's own float32 (several times cheaper on the CPU than a float64
            reduction, which copies the output). Runs inside the tap: tensor ops only,
            so that it compiles under ``torch.compile(fullgraph=True)``.
        decode: ``fn(accumulators [..., k], elements [...]) -> values [...]`` on the host, with
            the number of output elements they were taken over; NaN where undefined.
        description: what the value means, for the docs and ``help()``.
        label: the gradwatch tab's menu label.
        log_scale: drawn on a log axis (magnitudes over decades).
        write: ``fn(output, exact, cells)``: the same accumulators written straight into ``cells``
            (0-d views of the cells' dtype, one per accumulator), an op each where it can: an
            eager tap's first call of a sampled step, off the CPU's own reductions (the
            accelerators' path: no ``stack`` of the statistics). None: :func:`accumulate_all`'s stack.
    """

    name: str
    accumulators: tuple[str, ...]
    accumulate: Callable[[torch.Tensor, torch.dtype, bool], list[torch.Tensor]]
    decode: Callable[[np.ndarray, np.ndarray], np.ndarray]
    description: str = ""
    label: str = ""
    log_scale: bool = False
    write: Callable[[torch.Tensor, bool, list[torch.Tensor]], None] | None = None


#: A layer whose act_rms stayed within these bounds in a window has its next window's sums of squares
#: reduced in float32: far from float32's underflow (squares of |x| < ~1e-19 lose digits, of |x| <
#: ~4e-23 vanish) and overflow (|x| > ~1.8e19, or a sum above 3.4e38), relative error ~1e-7.
FLOAT32_SAFE_RMS = (1e-12, 1e12)


def float32_is_exact(values: np.ndarray, bounds: tuple[float, float] = FLOAT32_SAFE_RMS) -> bool:
    """Whether a layer's values of a window (NaN: not recorded) allow float32 sums next window: some
    recorded, all finite and within ``bounds`` (act_rms against :data:`FLOAT32_SAFE_RMS`; the output
    gradients' norms are held to ``capture.grad_statistics.FLOAT32_SAFE_NORM``)."""
    recorded = values[~np.isnan(values)]
    low, high = bounds
    return bool(recorded.size) and bool(np.all((recorded >= low) & (recorded <= high)))


#: Whether the CPU takes its own faster reductions: float32 rows where the last window allows it
#: (act_rms's sums of squares here, the output gradients' rows in ``capture.grad_statistics``),
#: and exact float32 rows with a float64 redo for large outputs elsewhere (``capture.cpu_rows``).
#: One switch: tests of the accelerators' op counts turn it off,
#: as there float64 accumulation is memory-bound and these add ops.
CPU_ROWS = True


def _sum_of_squares(out: torch.Tensor, dtype: torch.dtype, exact: bool) -> list[torch.Tensor]:
    if exact and CPU_ROWS and dtype == torch.float64 and cpu_rows.applies(out):
        # exact at any magnitude, at float32's speed: float32 rows, those it could not hold redone
        # (outside compiled code: which rows is a selection on the values)
        return [cpu_rows.square_sum(out, dtype)]
    cpu_window = not exact and out.dtype == torch.float32 and CPU_ROWS and out.device.type == "cpu"
    if cpu_window and cpu_rows.dot_applies(out):
        # one BLAS dot, in float32 (within ~5e-7: cpu_rows.DOT_MAX; the stack of the step's
        # accumulators is then float32, exact for the counts of such an output)
        return [cpu_rows.dot_square_sum(out)]
    rows = cpu_rows.memory_rows(out) if cpu_window else None
    if rows is not None:
        # The CPU accumulates a float32 reduction sequentially per vector lane: one norm of a
        # million-element output is off by ~1e-5 relative (1.6e-4 at 8M). Norms of 1024-element
        # rows (in memory order: channels-last too), combined in float64, are within ~1e-8 and
        # faster (62 against 86 us on a (32, 32, 32, 32) output; benchmarks/RESULTS.md).
        norms = torch.linalg.vector_norm(rows, dim=1).to(dtype)
        return [torch.dot(norms, norms)]
    return [_output_norm(out, dtype, exact).square()]


def _output_norm(out: torch.Tensor, dtype: torch.dtype, exact: bool) -> torch.Tensor:
    """The output's norm in one reduction: in the cells' dtype (float64) where ``exact`` or the output
    is not float32 (exact at any magnitude; the reduction copies the output), else in float32 where
    the last window shows it exact (the stack of the step's accumulators is then float32 too, a
    count above 2**24 rounding to 6e-8 relative; accurate to ~1e-7 on accelerators, tree
    reductions, and on small CPU outputs)."""
    if exact or out.dtype != torch.float32:
        return torch.linalg.vector_norm(out, dtype=dtype)
    return torch.linalg.vector_norm(out)


def _write_sum_of_squares(out: torch.Tensor, exact: bool, cells: list[torch.Tensor]) -> None:
    # as ``_sum_of_squares`` off the CPU's rows: the norm, squared into its cell
    (cell,) = cells
    torch.square(_output_norm(out, cell.dtype, exact), out=cell)


def _nonzeros(out: torch.Tensor, dtype: torch.dtype, exact: bool) -> list[torch.Tensor]:
    # an int64 count (stack promotes it to the cells' dtype)
    if (CPU_ROWS and out.device.type == "cpu" and out.dtype in _SAME_SIZE_INT and out.numel() >= _NONZERO_MIN
            and not torch.compiler.is_compiling()):  # fmt: skip
        return [_cpu_nonzeros(out)]
    return [torch.count_nonzero(out)]


#: The integer dtype of each floating dtype's size: the bits a float's magnitude is zero in.
_SAME_SIZE_INT = {torch.float32: torch.int32, torch.float64: torch.int64,
                  torch.float16: torch.int16, torch.bfloat16: torch.int16}
#: From this many elements :func:`_cpu_nonzeros` pays: below it its fixed ~10 us (a temporary, an op
#: more) is more than a float count of a ReLU's output costs (16K elements: 26 us against 19).
_NONZERO_MIN = 1 << 15
#: Elements taken at a time by :func:`_cpu_nonzeros`: its temporary never exceeds this many.
_NONZERO_CHUNK = 1 << 24


def _cpu_nonzeros(out: torch.Tensor) -> torch.Tensor:
    """The number of elements of a CPU float tensor that are not zero (-0.0 is zero; NaN is not), at
    the same price however many are zero. The CPU's float ``count_nonzero`` branches on each element:
    on a 1M-element float32 output 0.29 ms dense, 0.49 ms with 5% zeros, 2.1 ms with half of them
    zero (a ReLU's); counted on the bits of ``abs(out)`` (zero exactly for +0.0 and -0.0; NaN keeps
    bits), in any layout, it is 0.29 ms in all three (benchmarks/RESULTS.md, thirty-second session).
    The temporary is at most :data:`_NONZERO_CHUNK` elements: a larger output is counted in pieces
    where it is contiguous, else by the float count (no temporary)."""
    bits = _SAME_SIZE_INT[out.dtype]
    if out.numel() <= _NONZERO_CHUNK:
        return torch.count_nonzero(out.abs().view(bits))
    if not out.is_contiguous():
        return torch.count_nonzero(out)
    pieces = out.view(-1).split(_NONZERO_CHUNK)
    return torch.stack([torch.count_nonzero(piece.abs().view(bits)) for piece in pieces]).sum()


def _write_nonzeros(out: torch.Tensor, exact: bool, cells: list[torch.Tensor]) -> None:
    # the 0-"norm" counts the elements that are not 0.0 (-0.0 is one; NaN is not), in the cells' dtype,
    # written into its cell: one op (``count_nonzero`` has no out= of another dtype; on the CPU it is
    # faster, and the CPU's own path keeps it)
    (cell,) = cells
    torch.linalg.vector_norm(out, 0, dtype=cell.dtype, out=cell)


def _mean(accumulators: np.ndarray, elements: np.ndarray, root: bool = False) -> np.ndarray:
    value = np.where(elements > 0, accumulators[..., 0] / np.where(elements > 0, elements, 1.0), np.nan)
    return np.sqrt(value) if root else value


def _zero_fraction(accumulators: np.ndarray, elements: np.ndarray) -> np.ndarray:
    return 1.0 - _mean(accumulators, elements)


#: Every declared output statistic, in tag order.
OUTPUT_STATISTICS: tuple[OutputStatistic, ...] = (
    OutputStatistic(
        "act_rms", ("sum of squares",), _sum_of_squares, lambda a, n: _mean(a, n, root=True),
        description="root-mean-square of the layer's output over every element of the step's calls",
        label="activation RMS", log_scale=True, write=_write_sum_of_squares,
    ),
    OutputStatistic(
        "act_zero_fraction", ("non-zero elements",), _nonzeros, _zero_fraction,
        description="fraction of the layer's output elements that are exactly zero over the step's calls",
        label="activation zero fraction", write=_write_nonzeros,
    ),
)


def declared_accumulators() -> int:
    """The statistics' accumulators per layer and step: the width of :func:`accumulate_all`'s result."""
    return sum(len(s.accumulators) for s in OUTPUT_STATISTICS)


def accumulator_count() -> int:
    """Accumulators per layer and step: the output elements, then every statistic's (0: none declared)."""
    declared = declared_accumulators()
    return 1 + declared if declared else 0


def accumulate_all(out: torch.Tensor, dtype: torch.dtype, exact: bool = True,
                   into: torch.Tensor | None = None) -> torch.Tensor:
    """Every statistic's accumulators of one output, as one 1-D tensor (traceable); the element
    count is added by the tap (``out.numel()``, no op). ``exact``: see ``OutputStatistic``.
    ``into``: written there (``out=``, converted to its dtype: an eager tap's first call of a step)."""
    values = [value for s in OUTPUT_STATISTICS for value in s.accumulate(out, dtype, exact)]
    return torch.stack(values) if into is None else torch.stack(values, out=into)


def written_cells(stats: torch.Tensor) -> list[list[torch.Tensor]] | None:
    """Each statistic's 0-d views of a layer's accumulator cells ``stats`` (made once, by the tap), for
    :func:`write_all`; None where some statistic has no ``write``."""
    if not all(s.write is not None for s in OUTPUT_STATISTICS):
        return None
    views, start = [], 0
    for s in OUTPUT_STATISTICS:
        views.append([stats[start + k] for k in range(len(s.accumulators))])
        start += len(s.accumulators)
    return views


def writes_directly(out: torch.Tensor) -> bool:
    """Whether an eager first call writes each statistic into its cells (:func:`write_all`) rather
    than stacking them: off the CPU's own reductions (the accelerators' path, where each op is a
    kernel launch; on the CPU ``count_nonzero`` and the float32 rows are faster)."""
    return not (CPU_ROWS and out.device.type == "cpu")


def write_all(out: torch.Tensor, exact: bool, cells: list[list[torch.Tensor]]) -> None:
    """Every statistic's accumulators of one output written into ``cells`` (:func:`written_cells`):
    what ``accumulate_all(..., into=)`` writes, without the stack (one op less a layer)."""
    for s, statistic_cells in zip(OUTPUT_STATISTICS, cells):
        s.write(out, exact, statistic_cells)  # type: ignore[misc]


def decode_all(accumulators: np.ndarray) -> dict[str, np.ndarray]:
    """[..., accumulator_count()] -> {name: values [...]} for every declared statistic."""
    elements = accumulators[..., 0]
    values, start = {}, 1
    for s in OUTPUT_STATISTICS:
        stop = start + len(s.accumulators)
        with np.errstate(divide="ignore", invalid="ignore"):
            values[s.name] = s.decode(accumulators[..., start:stop], elements)
        start = stop
    return values
