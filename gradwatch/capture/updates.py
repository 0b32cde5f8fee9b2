"""Update-to-weight ratio: ||w_after - w_before|| / ||w_before|| around ``optimizer.step()``.

The change is measured, not derived from the optimizer's formulas, so it is
exact for any ``torch.optim`` optimizer (SGD with momentum and weight decay,
Adam, AdamW, fused and foreach variants, ...): a step pre-hook copies the
parameters about to change and takes their norms, a step post-hook subtracts
the new values from the copy in place and takes the norms of the difference.
Nothing is read back to the host; the results go into the buffer rows.

Memory stays bounded: there is no permanent copy of the model. The parameters
are measured in chunks (whole layers, up to ``CHUNK_BYTES`` each, more when a
window is too short to go round the model with that), and only one chunk is
copied at a time, from the pre-hook to the post-hook of one step. Each chunk is
measured at two consecutive optimizer steps of every flush window (positions
2c and 2c + 1 of the window for chunk c): every layer gets values in every
window, and two in a row tell a lasting condition from a one-step blip.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import numpy as np
import torch

from .._compat.fsdp1 import is_placeholder
from .devices import foreach_norm, index_tensor
from ..distributed.sharding import is_dtensor

log = logging.getLogger("gradwatch")

#: The most parameter bytes copied at once (unless a window is too short for that).
CHUNK_BYTES = 64 << 20
#: Elements per weight matrix in the per-step estimate: ``SAMPLE_RUNS`` runs of ``SAMPLE_RUN``
#: consecutive elements spread evenly over the flattened tensor (a matrix smaller than that: all of it).
SAMPLE_RUNS, SAMPLE_RUN = 16, 64
SAMPLE_ELEMENTS = SAMPLE_RUNS * SAMPLE_RUN


#: Why update_ratio is not measured on FSDP1's flat parameters: said at attach (the Lightning
#: callback passes the optimizer by itself), raised by ``GradMonitor.set_optimizer``.
NOT_ON_FLAT_PARAMETERS = (
    "update_ratio is not measured under FSDP1 with use_orig_params=False (the optimizer steps one flat "
    "parameter per wrapped unit, not the layers' parameters); pass use_orig_params=True to measure it"
)


def steps_flat_parameters(params: list[torch.Tensor]) -> bool:
    """Whether the monitored parameters are all gradwatch's placeholders of FSDP1's flat parameters
    (``use_orig_params=False``): no optimizer steps them, so their updates cannot be measured."""
    return bool(params) and all(is_placeholder(p) for p in params)


class UpdateRatio:
    """Optimizer hooks measuring the relative change of the monitored parameters in chunks."""

    def __init__(
        self,
        optimizer: Any,
        params: list[torch.Tensor],
        param_layer: np.ndarray,
        flush_every: int,
        write: Callable[[np.ndarray | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None], None],
        on_error: Callable[[str, BaseException], None],
        acc_dtype: torch.dtype,
        write_estimate: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        sample_columns: np.ndarray | None = None,
    ) -> None:
        if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "register_step_pre_hook")):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer (the one stepping the model), got "
                f"{type(optimizer).__name__}"
            )
        managed = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.columns = [j for j, p in enumerate(params) if id(p) in managed]
        if not self.columns:
            raise ValueError(
                "the optimizer holds none of the monitored layers' parameters, so their updates cannot be "
                "measured; pass the optimizer that steps this model (not a copy of its parameters)"
            )
        self._params: list[torch.Tensor] | None = params
        self._acc, self._write, self._on_error = acc_dtype, write, on_error
        self.chunks = _chunks(self.columns, params, param_layer, flush_every)
        self.flush_every = flush_every
        # The per-step estimate: a fixed sample of each weight matrix the check judges, read before
        # and after every optimizer step (views made once; the optimizer updates in place).
        self._write_estimate = write_estimate
        self._samples: SampledWeights | None = None
        if write_estimate is not None and sample_columns is not None and len(sample_columns):
            self._samples = SampledWeights([sample_view(params[j]) for j in sample_columns], acc_dtype)
        self._index: dict[int, torch.Tensor] = {}
        self._before: list[torch.Tensor] | None = None
        self._before_sq: torch.Tensor | None = None
        self._chunk: int | None = None
        self.optimizer_steps = 0
        self_ref = weakref.ref(self)

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            tracker = self_ref()
            if tracker is not None:
                tracker._pre()

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            tracker = self_ref()
            if tracker is not None:
                tracker._post()

        # Not traced when the optimizer step is compiled (torch.compile(opt.step)): the hooks pick
        # a chunk and a row by Python counters, on which dynamo would guard and recompile at every
        # step until its recompile limit sent the whole step back to eager. Kept out of the graph,
        # they run eagerly around it: a graph break each, a fixed number of graphs.
        pre, post = torch.compiler.disable(pre), torch.compiler.disable(post)
        self._handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

    def chunk_at(self, optimizer_step: int) -> int | None:
        """The chunk measured at this optimizer step (positions 2c and 2c + 1 of each window), or None."""
        position = optimizer_step % self.flush_every
        chunk = position // 2
        return chunk if chunk < len(self.chunks) else None

    def _local(self, columns: list[int]) -> list[torch.Tensor]:
        params = self._params or []
        return [(params[j].to_local() if is_dtensor(params[j]) else params[j]).detach() for j in columns]

    def _pre(self) -> None:
        step = self.optimizer_steps
        self.optimizer_steps += 1
        self._before = None
        if self._samples is not None:
            try:
                with torch.no_grad():
                    self._samples.before()
            except Exception as exc:
                self._samples.taken = False
                self._on_error("update_ratio (the per-step sample)", exc)
        chunk = self.chunk_at(step)
        self._chunk = chunk if self._params is not None else None  # scheduled: a row on every rank
        if self._chunk is None:
            return
        try:
            with torch.no_grad():
                current = self._local(self.chunks[chunk])
                before = torch._foreach_mul(current, 1.0)  # a transient copy of one chunk (x * 1 is exact)
                self._before_sq = torch.stack(foreach_norm(before, 2, self._acc)).square_()
                self._before, self._chunk = before, chunk
        except Exception as exc:
            self._before = None
            self._on_error("update_ratio (before the optimizer step)", exc)

    def _post(self) -> None:
        samples = self._samples
        if samples is not None and samples.taken and self._write_estimate is not None:
            try:
                with torch.no_grad():
                    self._write_estimate(*samples.after())
            except Exception as exc:
                self._on_error("update_ratio (the per-step sample)", exc)
        before, chunk = self._before, self._chunk
        self._before, self._chunk = None, None  # the copy lives from one pre-hook to its post-hook, no longer
        if chunk is None or self._params is None:
            return
        if before is None:  # the measurement failed on this rank: its row still exists, empty, as on
            self._write(None, None, None, None)  # the others (rows are the same on every rank)
            return
        try:
            with torch.no_grad():
                columns = self.chunks[chunk]
                torch._foreach_sub_(before, self._local(columns))  # w_before - w_after, in place
                update_sq = torch.stack(foreach_norm(before, 2, self._acc)).square_()
                index = self._index.get(chunk)
                if index is None:
                    index = self._index[chunk] = index_tensor(columns, update_sq.device)
                self._write(np.asarray(columns), index, update_sq, self._before_sq)  # type: ignore[arg-type]
        except Exception as exc:
            self._on_error("update_ratio (after the optimizer step)", exc)
            self._write(None, None, None, None)  # an empty row, as on the ranks where it worked
        finally:
            self._before_sq = None

    def remove(self) -> None:
        """Remove the optimizer hooks and forget the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._params = None
        self._before = None
        self._samples = None


class SampledWeights:
    """The per-step estimate's reads: each sampled matrix's sample before and after an optimizer step.

    Samples of ``SAMPLE_RUNS`` x ``SAMPLE_RUN`` elements (every matrix of at least
    ``SAMPLE_ELEMENTS``) come first (``sampled_columns`` orders them so) and are read together: one
    ``stack`` into a preallocated [m, runs, run] tensor and one norm over it, whatever the number
    of matrices (a foreach over strided views cost ~40 us per matrix on the CPU, 12 ms a step for
    256 matrices); smaller matrices, whole, take a foreach of their own.

    Args:
        samples: the sample views (``sample_view``), in ``sampled_columns`` order.
        acc: the dtype of the norms.
    """

    def __init__(self, samples: list[torch.Tensor], acc: torch.dtype) -> None:
        shape, first = (SAMPLE_RUNS, SAMPLE_RUN), samples[0]
        # the leading full samples of one dtype and device (stack needs both); any other: the rest
        count = 0
        while count < len(samples) and tuple(samples[count].shape) == shape and \
                samples[count].dtype == first.dtype and samples[count].device == first.device:
            count += 1
        self.runs, self.rest = samples[:count], samples[count:]
        self._before = torch.empty((len(self.runs), *shape), dtype=first.dtype, device=first.device)
        self._after = torch.empty_like(self._before)
        self._acc = acc
        self._rest_before: list[torch.Tensor] = []
        self._weight_norms: torch.Tensor | None = None
        self.taken = False  # a before-read waits for its after-read

    def before(self) -> None:
        """Read the samples before the optimizer step (their norms: the weights')."""
        self.taken = False
        norms = []
        if self.runs:
            torch.stack(self.runs, out=self._before)
            norms.append(torch.linalg.vector_norm(self._before, 2, dim=(1, 2), dtype=self._acc))
        if self.rest:
            self._rest_before = torch._foreach_mul(self.rest, 1.0)  # a copy (x * 1 is exact)
            norms.append(torch.stack(foreach_norm(self._rest_before, 2, self._acc)))
        self._weight_norms = norms[0] if len(norms) == 1 else torch.cat(norms)
        self.taken = True

    def after(self) -> tuple[torch.Tensor, torch.Tensor]:
        """After the optimizer step: (norms of the samples' updates, norms of the weights before)."""
        self.taken = False
        norms = []
        if self.runs:
            torch.stack(self.runs, out=self._after)
            norms.append(torch.linalg.vector_norm(self._before.sub_(self._after), 2, dim=(1, 2), dtype=self._acc))
        if self.rest:
            torch._foreach_sub_(self._rest_before, self.rest)  # w_before - w_after
            norms.append(torch.stack(foreach_norm(self._rest_before, 2, self._acc)))
        assert self._weight_norms is not None
        return (norms[0] if len(norms) == 1 else torch.cat(norms)), self._weight_norms


def sample_view(p: torch.Tensor) -> torch.Tensor:
    """``SAMPLE_RUNS`` runs of ``SAMPLE_RUN`` consecutive elements of ``p``, evenly spread over the
    flattened tensor (every part of it represented: rows, channels, embedding rows), as one
    [runs, run] view; a tensor smaller than ``SAMPLE_ELEMENTS``: all of it, flattened. Runs of
    consecutive elements rather than every k-th element: gathering 1024 scattered elements touches
    1024 cache lines, 16 runs touch 64."""
    flat = p.detach().reshape(-1)  # a view of a contiguous parameter
    n = flat.numel()
    if n < SAMPLE_ELEMENTS:
        return flat
    return flat.as_strided((SAMPLE_RUNS, SAMPLE_RUN), (n // SAMPLE_RUNS, 1), flat.storage_offset())


def sampled_columns(params: list[torch.Tensor]) -> np.ndarray:
    """The columns the per-step estimate covers: weight matrices and kernels (>= 2-D), not sharded,
    contiguous (their flattened view shares their memory); those with a full sample first, so that
    ``SampledWeights`` reads them together."""
    columns = [j for j, p in enumerate(params) if p.ndim >= 2 and not is_dtensor(p) and p.is_contiguous()]
    columns.sort(key=lambda j: params[j].numel() < SAMPLE_ELEMENTS)  # stable: model order within each
    return np.array(columns, dtype=np.int64)


def _chunks(columns: list[int], params: list[torch.Tensor], param_layer: np.ndarray, flush_every: int) -> list[list[int]]:
    """Columns grouped into chunks of whole layers, small enough to copy, few enough to fit a window."""
    by_layer: dict[int, list[int]] = {}
    for j in columns:
        by_layer.setdefault(int(param_layer[j]), []).append(j)
    sizes = {layer: sum(_nbytes(params[j]) for j in cols) for layer, cols in by_layer.items()}
    total = sum(sizes.values())
    slots = max(1, flush_every // 2)  # chunks measured per window, two steps each
    budget = max(CHUNK_BYTES, -(-total // slots))
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for layer in sorted(by_layer):
        if current and used + sizes[layer] > budget:
            chunks.append(current)
            current, used = [], 0
        current += by_layer[layer]
        used += sizes[layer]
    if current:
        chunks.append(current)
    while len(chunks) > slots:  # layers larger than the budget: merge neighbours
        chunks[-2:] = [chunks[-2] + chunks[-1]]
    return chunks


def _nbytes(p: torch.Tensor) -> int:
    local = p.to_local() if is_dtensor(p) else p
    return local.numel() * local.element_size()
