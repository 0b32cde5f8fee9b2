"""Interleaved timing: every contender steps once per round, in orders where each one follows
every other equally often (:func:`balanced_orders`)."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class Result:
    name: str
    times: list[float] = field(default_factory=list)
    buffer_bytes: int | None = None
    peak_bytes: int | None = None
    #: what the contender reported when it closed (e.g. whether gradwatch recorded output gradients)
    report: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` contenders (a Williams design) in which each one runs first, second, ... equally
    often and right after each other one equally often: once each over the ``n`` orders for even
    ``n``, twice over ``2n`` for odd ``n`` (the orders and their reverses).

    A step's time can depend on the step before it (what that step left in the caches and the
    allocator's free lists): orders rotated by one each round (A B C / B C A / C A B) kept each
    contender's predecessor fixed, a confound in every comparison. It was not what made the A/A
    control read below the unmonitored run in 10 of 14 runs of the thirty-second to thirty-fourth
    sessions (by 0.05-0.78 points): with these orders it still did (-0.6 to -0.9 points in three
    compiled MLP runs), and it moved with how the copies were made, not with the order (made in
    reverse: +0.04; listed first, the unmonitored copy made second read -1.0; after a decoy copy
    made and stepped first: +0.69; thirty-fourth session). That was glibc's allocator, where each
    copy's large blocks landed: :func:`steady_allocator` removes most of it (thirty-fifth session)."""
    first = [(k + 1) // 2 if k % 2 else (n - k // 2) % n for k in range(n)]  # 0, 1, n-1, 2, n-2, ...
    orders = [[(c + shift) % n for c in first] for shift in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def steady_allocator() -> bool:
    """Have glibc's malloc keep the memory a CPU run frees, so that a step's allocations cost the same
    for every model copy in the process: blocks up to 32 MiB from the heap rather than fresh
    mappings, and the heap's top never handed back to the system. Returns whether it applied (glibc
    only); call it before the models are made.

    With glibc's defaults, a block above its dynamic threshold (128 KiB at first) is a mapping of
    its own, zero-filled page by page when touched again, and freed memory at the top of the heap is
    given back; which of a copy's tensors land where depends on when it was made and next to what.
    Measured on the compiled MLP 8x512 (benchmarks/RESULTS.md, thirty-fifth session), per phase of
    a step, medians over 400 interleaved steps: the optimizer's step took 7.8-8.3 ms by the copy
    (none, gradwatch, the two floors) with the defaults and 5.3-5.5 ms for all of them with this;
    the unmonitored copy and its A/A twin then differed by 23 us in a 30 ms step. This is what
    made one process resolve only about a point between contenders (thirty-fourth session), and it
    is what an allocator that keeps its memory (PyTorch's tuning guide suggests jemalloc or
    tcmalloc for CPU training) does too. Accelerators' caching allocators keep theirs anyway."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def allocator_option(parser) -> None:  # type: ignore[no-untyped-def]
    """A script's ``--allocator`` option: steady (:func:`steady_allocator`, the default) or glibc's own."""
    parser.add_argument("--allocator", choices=("steady", "default"), default="steady",
                        help="steady (default): glibc keeps freed memory (harness.steady_allocator), so that every "
                             "model copy's allocations cost alike; default: glibc's own settings")  # fmt: skip


def use_allocator(choice: str) -> str:
    """Apply ``--allocator`` (scripts' ``main`` only: it is process-wide); returns what is in use."""
    return "steady" if choice == "steady" and steady_allocator() else "default"


def measure(workload, contender_types, rounds: int, warmup: int, device: torch.device,
            sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
            creation_order: list[int] | None = None) -> list[Result]:  # fmt: skip
    """Time ``rounds`` steps of each contender, interleaved in :func:`balanced_orders` taken in turn, on
    identical model copies (``clock``: the timer, replaceable by a test). ``creation_order``: the
    contenders' indices in the order their copies are made (default: as listed). Which copy is
    made when decides where its memory lies, and two copies doing the same work can differ by up
    to a point in one process (benchmarks/RESULTS.md, thirty-ninth session): balanced orders do not
    cancel that, a different creation order in each process does (:func:`creation_order_for`)."""
    listed = list(range(len(contender_types)))
    order = listed if creation_order is None else list(creation_order)
    if sorted(order) != listed:  # checked before any copy (and its hooks) is made
        raise ValueError(f"creation_order {creation_order} must name each of the {len(contender_types)} "
                         "contenders' indices once")  # fmt: skip
    torch.manual_seed(0)
    base = workload.make_model().to(device)
    made: dict[int, Any] = {}
    for i in order:
        made[i] = contender_types[i](copy.deepcopy(base), workload, device)
    contenders = [made[i] for i in listed]
    share_one_batch(contenders)
    results = {c.name: Result(c.name) for c in contenders}
    orders = balanced_orders(len(contenders))
    for r in range(warmup):  # interleaved, as the timed rounds
        for c in (contenders[i] for i in orders[r % len(orders)]):
            c.step()
    for c in contenders:
        c.prime()
    gc.collect()
    gc.disable()  # a collection landing in one contender's step is noise, not cost
    try:
        for r in range(rounds):
            for c in (contenders[i] for i in orders[r % len(orders)]):
                if sync:
                    sync()
                t0 = clock()
                c.step()
                if sync:
                    sync()
                results[c.name].times.append(clock() - t0)
    finally:
        gc.enable()
    for c in contenders:
        c.close()  # (a gradwatch contender reads its device memory there, outside the timed steps)
        results[c.name].buffer_bytes = getattr(c, "buffer_bytes", None)
        results[c.name].report = dict(getattr(c, "report", {}))
    return [results[c.name] for c in contenders]


def share_one_batch(contenders: list) -> None:
    """Every contender steps on the first one's batch. Each copy drew a batch of its own (in the order
    the copies were made), so the copies' gradients and Adam states differed, and with them the work
    of the optimizer's step: MKL's sqrt takes a slower path for some values (``vssqrt_cout_rare``),
    and callgrind counted one copy's optimizer step 0.4 M instructions (~0.5% of the step) above
    another's doing the same work (benchmarks/RESULTS.md, forty-fourth session): a per-copy offset
    fixed for a whole process."""
    for c in contenders[1:]:
        c.batch = contenders[0].batch


def creation_order_for(n: int, seed: int | None) -> list[int] | None:
    """A creation order of ``n`` contenders for :func:`measure`: None (as listed) where ``seed`` is None,
    else a permutation drawn from ``seed`` (one per process, so that averages over processes do
    not carry a copy's place in memory)."""
    if seed is None:
        return None
    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


class SyncCounter(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``) and device-to-host copies."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        elif func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None:
            if torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu":
                self.count += 1
        return func(*args, **kwargs)


def host_syncs_between_flushes(workload, device: torch.device, steps: int = 8) -> tuple[int, int]:
    """(syncs in unmonitored steps, syncs in gradwatch's non-flush steps), same loop."""
    from .contenders import Unmonitored, gradwatch_contender

    torch.manual_seed(0)
    base = workload.make_model().to(device)
    plain = Unmonitored(copy.deepcopy(base), workload, device)
    watched = gradwatch_contender(50)(copy.deepcopy(base), workload, device)
    for c in (plain, watched):
        for _ in range(2):
            c.step()
    counts = []
    for c in (plain, watched):
        with SyncCounter() as counter:
            for _ in range(steps):
                c.step()
        counts.append(counter.count)
        c.close()
    return counts[0], counts[1]


def paired_ratio(result: Result, base: Result, resamples: int = 2000) -> tuple[float, float, float]:
    """Median over rounds of (this step / the unmonitored step of the same round), with a
    bootstrap 95% interval. Pairing within a round cancels the machine's slow drift."""
    import numpy as np

    ratios = np.asarray(result.times) / np.asarray(base.times)
    low, high = _bootstrap_95(ratios, np.median, resamples)
    return float(np.median(ratios)), low, high


def _bootstrap_95(values, statistic, resamples: int) -> tuple[float, float]:
    """A bootstrap 95% interval of ``statistic`` (a numpy reduction taking ``axis``) over ``values``
    (a 1-d array), with a fixed seed: the same run gives the same interval."""
    import numpy as np

    rng = np.random.default_rng(0)
    estimates = statistic(rng.choice(values, size=(resamples, values.size)), axis=1)
    low, high = np.percentile(estimates, [2.5, 97.5])
    return float(low), float(high)


def window_gap(base: Result, first: Result, second: Result, window: int,
               resamples: int = 2000) -> tuple[float, float, float, int]:  # fmt: skip
    """How far ``first`` is above ``second`` over whole windows of ``window`` rounds (rounds start at
    a window's first step), in points of the unmonitored time: per window, (first's time - second's)
    / base's time x 100; their mean over the windows with a bootstrap 95% interval (resampling whole
    windows, which each hold their sampled steps and flush), and the number of windows. A window is
    the unit a "within N points of the floor" claim is about; its interval says whether the run
    can tell."""
    import numpy as np

    n = len(base.times) // window
    if n == 0:
        return float("nan"), float("nan"), float("nan"), 0
    shape = (n, window)
    b, f, s = (np.asarray(r.times[: n * window]).reshape(shape).sum(axis=1) for r in (base, first, second))
    gaps = (f - s) / b * 100
    low, high = _bootstrap_95(gaps, np.mean, resamples)
    return float(gaps.mean()), low, high, n


def figure_table(results: list[Result]) -> dict[str, dict]:
    """Each contender's figures against the first (the unmonitored one), for a JSON report."""
    base = results[0]
    return {
        r.name: {"median_ms": r.median * 1e3, "ratio": r.median / base.median, "paired_ratio": paired_ratio(r, base),
                 "mean_ratio": r.mean / base.mean, "buffer_bytes": r.buffer_bytes}
        for r in results
    }  # fmt: skip


def per_layer_us(result: Result, base: Result, layers: int) -> float:
    """Median over rounds of (this step - the unmonitored step of the same round) / layers, in us."""
    import numpy as np

    return float(np.median(np.asarray(result.times) - np.asarray(base.times)) / layers * 1e6)


def format_table(workload_name: str, results: list[Result]) -> str:
    base = results[0]
    lines = [f"\n## {workload_name}  (median unmonitored step {base.median * 1e3:.2f} ms, {len(base.times)} rounds)"]
    lines.append(f"{'contender':34s} {'median ms':>10s} {'ratio':>7s} {'paired [95% CI]':>22s} "
                 f"{'mean ratio':>11s} {'buffer':>10s}")  # fmt: skip
    for r in results:
        buf = "-" if r.buffer_bytes is None else _bytes(r.buffer_bytes)
        paired, low, high = paired_ratio(r, base)
        interval = f"{paired:.3f} [{low:.3f}, {high:.3f}]"
        lines.append(f"{r.name:34s} {r.median * 1e3:10.2f} {r.median / base.median:7.3f} {interval:>22s} "
                     f"{r.mean / base.mean:11.3f} {buf:>10s}")  # fmt: skip
    return "\n".join(lines)


def _bytes(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


@contextlib.contextmanager
def gradwatch_logger_at(level: int) -> Iterator[None]:
    """The ``gradwatch`` logger at ``level`` inside the block, restored after it: a benchmark counts
    the alerts it provokes instead of printing them, and a caller running it in-process (the smoke
    tests) keeps its own level."""
    logger = logging.getLogger("gradwatch")
    saved = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(saved)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it: in all (``count``) and per op (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(workload, contender_type, device: torch.device, window: int = 50, counted: int | None = None) -> float:
    """Mean aten ops per step of a contender over ``counted`` steps (default: one whole flush
    window, its sampled steps and its flush included), after a first window of warm-up."""
    torch.manual_seed(0)
    contender = contender_type(workload.make_model().to(device), workload, device)
    for _ in range(window):
        contender.step()
    counted = counted or window
    counter = OpCounter()
    with counter:
        for _ in range(counted):
            contender.step()
    contender.close()
    return counter.count / counted


def time_calls(owner, attr: str, label: str, into: dict[str, list[float]], unit: float = 1e3) -> tuple:
    """Wrap ``owner.attr`` (a bound object's method, a module's function, or a class's method) so
    that each call adds its time to ``into[label]``, in seconds times ``unit`` (1e3: milliseconds).
    Returns ``(owner, attr, original)``: ``setattr(*it)`` puts it back (modules and classes are
    shared with the rest of the process)."""
    inner = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into[label].append((time.perf_counter() - start) * unit)

    setattr(owner, attr, wrapper)
    return owner, attr, inner
