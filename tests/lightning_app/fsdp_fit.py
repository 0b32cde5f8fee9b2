"""A Lightning fit under FSDP1 on 2 CPU processes, with GradWatch: python -m tests.lightning_app.fsdp_fit OUT

Lightning refuses ``FSDPStrategy`` with ``accelerator="cpu"`` by an exact type check
(``_AcceleratorConnector._check_strategy_and_fallback``: "The strategy `fsdp` requires a GPU
accelerator"), and its own wrapping passes ``device_id=None``, which FSDP1 refuses without an
accelerator. So this fit uses ``CPUFSDPStrategy``, Lightning's ``FSDPStrategy`` under another
class name (nothing overridden), and wraps the model in ``configure_model`` with an auto-wrap
policy and ``device_id=cpu``, a path Lightning supports (it then leaves the model's wrapping as
it is). Everything else (launch, optimizer set-up, the training loop, the callback) is Lightning's.

Each rank records, before every optimizer step, each layer's whole gradient as FSDP gathers it
(``summon_full_params(with_grads=True)``), and writes OUT/rank<R>.json; rank 0 writes TensorBoard.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

from gradwatch import GradWatch

from .model import L, Regressor

LAYERS = ("net.0", "net.2", "net.4")


class CPUFSDPStrategy(L.strategies.FSDPStrategy):
    """Lightning's FSDPStrategy, under another name so that Lightning lets it run on CPU."""


class ShardedRegressor(Regressor):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        if not isinstance(self.net, FullyShardedDataParallel):
            self.net = FullyShardedDataParallel(self.net, use_orig_params=True, device_id=torch.device("cpu"),
                                                sharding_strategy=ShardingStrategy.FULL_SHARD,
                                                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))  # fmt: skip

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class WholeGradients(L.Callback):
    """Each layer's whole gradient norm before every optimizer step, gathered by FSDP."""

    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(pl_module.net, with_grads=True):
            inner = pl_module.net.module
            self.norms.append({name: float(torch.cat([p.grad.reshape(-1).double() for p in
                                                      inner.get_submodule(name[4:]).parameters()]).norm())
                               for name in LAYERS})  # fmt: skip


def main(out: str) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    torch.manual_seed(0)
    whole = WholeGradients()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(), max_steps=6, limit_val_batches=0,
        logger=TensorBoardLogger(out, name="run", version=0), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=out, callbacks=[GradWatch(flush_every=3, detail="full"), whole],
    )  # fmt: skip
    model = ShardedRegressor(width=16, dead_first_layer=False)
    trainer.fit(model, torch.utils.data.DataLoader(torch.arange(4096), batch_size=8))
    hooks = sum(len(m._forward_hooks) for m in model.modules() if not type(m).__name__.startswith("FullySharded"))
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"whole": whole.norms, "hooks_left": hooks}, f)


if __name__ == "__main__":
    main(sys.argv[1])
