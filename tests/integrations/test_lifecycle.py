"""The shared lifecycle's small rules (gradwatch/integrations/lifecycle.py)."""

from __future__ import annotations

import logging

import torch

from gradwatch.integrations.lifecycle import watchable_optimizer


def test_the_optimizer_for_update_ratio_is_unwrapped_or_left_out_with_one_warning(caplog):
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)

    class Wrapper:  # what accelerate's AcceleratedOptimizer looks like to gradwatch: .optimizer
        optimizer = sgd

    class ZeroOptimizer:  # DeepSpeed's ZeRO optimizer: not a torch.optim.Optimizer (no step hooks)
        def step(self) -> None:
            pass

    assert watchable_optimizer(sgd) is sgd and watchable_optimizer(Wrapper()) is sgd
    assert watchable_optimizer(None) is None
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        assert watchable_optimizer(ZeroOptimizer()) is None
    assert ["update_ratio is not measured" in r.getMessage() and "ZeroOptimizer" in r.getMessage()
            for r in caplog.records] == [True]
