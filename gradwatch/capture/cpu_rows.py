"""Exact sums of squares of float32 tensors on the CPU, at float32's speed, outside compiled code.

On the CPU a float64 reduction of float32 values is 5-10x slower than a float32 one (the cast is
not vectorised: a (32, 32, 32, 32) output's float64 norm takes ~1.4 ms against ~0.12 ms for
float32 rows). So these reduce in float32 rows, each row's sum accurate to ~1e-7 relative
(PyTorch's cascade sums), and redo in float64 the rows whose float32 sums could be wrong: a sum
below :data:`LOW` (squares under ~1e-38 lose digits or vanish; a row of zeros is redone too) or
above :data:`HIGH` or not finite (a square overflowed past ~3.4e38, or the row holds NaN or
inf). Every other row's squares were normal float32 numbers, so its sum is as exact as float32
sums are, and the result is exact at any magnitude.

Which rows to redo is a selection on the values (a boolean mask), made without reading anything
back to the host (no branch in Python: where no row is suspect the redo selects nothing; a numpy
check of the sums instead saved ~0.1 ms a call, ~7% of a compiled conv net's sampled-step
statistics, and is a host read the no-sync rule counts). Callers take it only where :func:`applies`:
eager code, and the run-time kernels of ``capture/host_branch.py``. Traced code keeps its float64
reductions: inductor fuses their cast, and a selection whose size depends on the values would put
data-dependent shapes into the user's graphs.
"""

from __future__ import annotations

import torch

#: A float32 row's sum of squares at or above this lost at most ~1e-45 per element to underflow:
#: ~1e-8 relative for rows of up to ten million elements.
LOW = 1e-30
#: Below float32's largest value (3.4e38): a finite sum of non-negative squares up to here overflowed nowhere.
HIGH = 3.0e38
#: Elements per row of a whole tensor's sum (:func:`memory_rows`): short enough that the CPU's
#: sequential per-lane float32 accumulation stays within ~1e-7 of each row's sum.
ROW = 1024
#: Up to this many elements a contiguous float32 tensor's sum of squares in a float32 window (its
#: magnitudes far from float32's limits: ``registry.outputs.float32_is_exact``,
#: ``capture.grad_statistics.FLOAT32_SAFE_NORM``) is one BLAS dot of its flat view
#: (:func:`dot_square_sum`): relative error within ~5e-7 (4.2e-7 measured at 2**18 elements, normal,
#: rectified and shifted values; 9e-7 at 2**19, 3.6e-6 at 2**20: the dot's error grows with the length),
#: at about half the time of :data:`ROW` rows normed in float32 and combined in float64 (~1e-8; 10 against 19
#: us on 131K elements in cache). Larger tensors keep the rows.
DOT_MAX = 1 << 18
#: Below this many elements the redo's few fixed ops (~0.1 ms) cost more than a float64 reduction
#: saves: 0.22 against 0.09 ms on a (256, 512) tensor, 0.26 against 0.64 on (32, 64, 16, 16).
MIN_ELEMENTS = 1 << 18


def applies(x: torch.Tensor) -> bool:
    """Whether ``x``'s sums of squares are worth taking here: float32 on the CPU, of at least
    :data:`MIN_ELEMENTS`, outside compiled code."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() >= MIN_ELEMENTS
            and not torch.compiler.is_compiling())  # fmt: skip


def square_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum of ``x``'s squares, a 0-d tensor of ``dtype`` (float64): exact, in any layout.

    Raises:
        ValueError: ``x`` is not a float32 CPU tensor (:func:`applies`).
    """
    _check(x)
    rows = memory_rows(x)
    if rows is None:
        return torch.linalg.vector_norm(x, dtype=dtype).square()  # an odd layout or size: the float64 read
    squares = _redone(torch.linalg.vector_norm(rows, dim=1).square(), rows, dtype)
    return squares.sum()


def dot_applies(x: torch.Tensor) -> bool:
    """Whether a float32 CPU tensor of a float32 window takes :func:`dot_square_sum`: contiguous, of at
    most :data:`DOT_MAX` elements, eager (the callers check dtype, device and window)."""
    return x.numel() <= DOT_MAX and x.is_contiguous()


def dot_square_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x``'s squares, 0-d float32: one BLAS dot of its flat view (where :func:`dot_applies`)."""
    flat = x.view(-1)
    return torch.dot(flat, flat)


def channel_row_squares(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (N, C, *spatial): each (sample, channel)'s sum of squares over its positions, (N, C) of
    ``dtype``: exact, contiguous or channels-last (other layouts: one float64 reduction).

    Raises:
        ValueError: ``x`` is not a float32 CPU tensor (:func:`applies`) of at least 3 dimensions.
    """
    _check(x)
    if x.ndim < 3:
        raise ValueError(f"channel_row_squares needs (N, C, *spatial), got a tensor of shape {tuple(x.shape)}")
    n, c = x.shape[0], x.shape[1]
    positions = tuple(range(2, x.ndim))
    if x.is_contiguous():
        squares = x.reshape(n, c, -1).square().sum(2)
    else:
        last = x.permute(0, *positions, 1)  # channels-last: (N, *spatial, C) is the memory order
        if not last.is_contiguous():
            return torch.linalg.vector_norm(x, dim=positions, dtype=dtype).square()
        squares = last.reshape(n, -1, c).square().sum(1)
    return _redone(squares, x, dtype)


def _redone(squares: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``squares`` (float32 sums over ``x``'s trailing dimensions) in ``dtype``, with the rows float32
    could not hold (outside [LOW, HIGH], NaN included) summed again in ``dtype``. No branch on the
    host: where no row is suspect the redo reads an empty selection."""
    exact = squares.to(dtype)
    suspect = ~((squares >= LOW) & (squares <= HIGH))
    again = x[suspect].to(dtype)
    exact[suspect] = again.square().sum(dim=tuple(range(1, again.ndim)))
    return exact


def memory_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x``'s elements as rows of :data:`ROW` in memory order (a view: contiguous, or permuted from
    channels-last and the like), for sums that do not care about the order; None where they do not
    fill whole rows of one dense block (fewer elements, a size that is no multiple, gaps)."""
    numel = x.numel()
    if numel < ROW or numel % ROW:
        return None
    if not x.is_contiguous():  # (contiguous: no permute, one op less on the eager path)
        x = x.permute(sorted(range(x.ndim), key=lambda d: (-x.stride(d), -x.shape[d])))
        if not x.is_contiguous():
            return None
    return x.view(-1, ROW)


def _check(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"cpu_rows sums float32 CPU tensors, got {x.dtype} on {x.device}: check applies(x) first")
