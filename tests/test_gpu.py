"""Checks that need a CUDA device (skipped without one; benchmarks/gpu_check.py does more)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradwatch import GradMonitor

from .reference import own_grad_norm

pytestmark = pytest.mark.gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("detail", ["standard", "full"])
def test_no_host_sync_between_flushes_on_cuda(detail):
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Flatten(), nn.Linear(8 * 64, 10),
    ).to(device)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = GradMonitor(model, flush_every=30, detail=detail, optimizer=opt)
    x, y = torch.randn(4, 3, 8, 8, device=device), torch.randint(0, 10, (4,), device=device)

    def step():
        nn.functional.cross_entropy(model(x), y).backward()
        monitor.step()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # caches built, index tensors on the device
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(26):  # steps 3..28 of a 30-step window: none flushes; 25 is sampled
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    nn.functional.cross_entropy(model(x), y).backward()
    expected = {name: own_grad_norm(model.get_submodule(name)) for name in monitor.layers}
    monitor.step()
    monitor.flush()
    w = monitor.last_window
    for name, value in expected.items():
        assert w.grad_norm[-1, w.layers.index(name)] == pytest.approx(value, rel=1e-4)
    monitor.close()


@cuda
def test_a_model_moved_to_the_gpu_after_attaching_is_one_clear_error(caplog):
    import logging

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    monitor = GradMonitor(model, flush_every=2)  # attached on the CPU
    model.cuda()  # the same Parameter objects, now on the GPU
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for _ in range(4):
            model(torch.randn(3, 4, device="cuda")).sum().backward()
            monitor.step()
            model.zero_grad()
        monitor.close()
    errors = [r for r in caplog.records if "moved from cpu to cuda" in r.getMessage()]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR


@cuda
def test_compiled_model_on_cuda_records_output_gradients_without_a_sync():
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    monitor = GradMonitor(model, flush_every=30)
    run = torch.compile(model)
    x = torch.randn(32, 64, device=device)
    for _ in range(3):  # compiled graphs for sampled and unsampled steps
        run(x).square().mean().backward()
        monitor.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            run(x).square().mean().backward()
            monitor.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monitor.flush()
    assert monitor.last_window.out_seen[0].all()
    monitor.close()
