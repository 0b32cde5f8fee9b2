"""Shared helpers: reading TensorBoard event files back, small models."""

from __future__ import annotations

import glob
import logging
import os
from collections import defaultdict

import pytest
import torch
from torch import nn

# Strict mode (gradwatch/failures.py): a programming error inside gradwatch fails the test that hits it
# instead of becoming one logged warning. Worker processes (gloo) inherit it.
os.environ.setdefault("GRADWATCH_STRICT", "1")


# The suite runs in pytest-xdist workers (pyproject.toml's addopts: ``-n auto``; ``-n 0`` runs it in
# one process, for a debugger). On the 2-core machine it is written for, about half of its wall
# time is spent waiting on other processes (gloo ranks, torchrun, TensorBoard servers, a browser),
# so a second worker takes about a third off. Each worker gets its share of the cores for torch's
# intra-op threads, so the workers do not fight over them.
_MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown with -p no:xdist
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most ``_MAX_WORKERS`` (each imports torch, Lightning
    and transformers: ~1.5 GB of memory each)."""
    return max(1, min(_MAX_WORKERS, os.cpu_count() or 1))


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(autouse=True)
def _gradwatch_logger_restored():
    """Every test starts with the ``gradwatch`` logger as the process had it. The benchmarks silence
    it while they run; ``gpu_check.main``, run in-process by a smoke test, left it at ERROR, and a
    test that ran after it in the same xdist worker lost every warning logged outside its own
    ``caplog.at_level`` block (a CI failure on 2026-12-04). ``gpu_check.main`` restores it now;
    this keeps any test that changes the logger from reaching the next."""
    logger = logging.getLogger("gradwatch")
    saved = logger.level, logger.disabled, logger.propagate
    yield
    logger.level, logger.disabled, logger.propagate = saved


@pytest.fixture
def lenient(monkeypatch):
    """For tests that inject an error gradwatch must survive as a user's run would: strict mode off."""
    monkeypatch.setenv("GRADWATCH_STRICT", "0")


def read_scalars(logdir: str) -> dict[str, dict[int, float]]:
    """Every scalar under ``logdir`` as {tag: {step: value}}, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = defaultdict(dict)
    files = glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)
    assert files, f"no event files under {logdir}"
    for path in files:
        acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for name in acc.Tags()["scalars"]:
            for event in acc.Scalars(name):
                out[name][event.step] = event.value
    return dict(out)


def regression_batches(n_in=16, n_out=4, batch=32, seed=0):
    """make() -> (x, y): random inputs and a fixed teacher's tanh targets, a learnable task."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(n_in, n_out, generator=g) / n_in**0.5

    def make():
        x = torch.randn(batch, n_in)
        return x, torch.tanh(x @ teacher)

    return make


def sigmoid_stack(depth: int = 30, width: int = 32, n_out: int = 4) -> nn.Module:
    """A deep stack of sigmoid layers with small weights: its first layers' gradients vanish
    (Glorot and Bengio 2010)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        lin = nn.Linear(width, width)
        nn.init.normal_(lin.weight, std=0.05)
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.Sigmoid()]
    return nn.Sequential(*layers, nn.Linear(width, n_out))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["cpu-path", "device-agnostic"])
def param_path(request, monkeypatch):
    """Both paths of the parameter-gradient statistics: the CPU's own (float32 slots checked on the
    host, BLAS for large tensors) and the device-agnostic one accelerators take (float64 foreach
    norms, counts on sampled steps), here run on CPU tensors so that every commit tests it."""
    import gradwatch.capture.param_stats as param_stats

    monkeypatch.setattr(param_stats, "CPU_FAST_PATH", request.param == "cpu-path")
    return request.param


@pytest.fixture(params=["cpu-path", "device-agnostic"])
def gloo_param_path(request, monkeypatch):
    """``param_path`` for the ranks of a ``gloo`` test: each rank process takes this path (read by
    ``tests/gloo_worker.py`` from the environment), so that DDP and the pipeline's union layout run
    the path GPU users get on every commit."""
    from .gloo_worker import PARAM_PATH_VARIABLE

    monkeypatch.setenv(PARAM_PATH_VARIABLE, request.param)
    return request.param


class TwoBranch(nn.Module):
    """A model whose forward calls one layer twice and uses keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(input=h))
        return self.head(h)


@pytest.fixture
def gloo(tmp_path):
    """Run a scenario in real gloo processes (CPU): ``gloo("tests.distributed.fsdp_worker:body", 2,
    "flat")`` calls ``body(rank, world, "flat")`` on each of 2 ranks and returns each rank's JSON.
    Every distributed test starts its processes this way (``tests/gloo_worker.py``)."""
    from .dist_helpers import spawn

    def run(scenario: str, world: int, *args: str, timeout: float = 240) -> list:
        return spawn("tests.gloo_worker", world, str(tmp_path / "out"), *args, timeout=timeout, scenario=scenario)

    return run
