"""Worker for the torchrun tests: python -m torch.distributed.run --nproc_per_node 2 tests/integrations/hf_worker.py OUT RUNS

Two CPU processes (gloo) train a tiny GPT-2 with the Hugging Face Trainer and GradWatchCallback,
once per name in RUNS (comma-separated, one after the other in the same processes: one launch
instead of one each): "ddp" (DDP), "2" or "3" (DeepSpeed ZeRO at that stage, its CPU accelerator);
each writes what it saw to OUT/<run>/rank<R>.json.
"""

import json
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gradwatch.hf import GradWatchCallback  # noqa: E402
from tests.dist_helpers import deepspeed_on_cpu  # noqa: E402
from tests.integrations.test_hf import _Tokens  # noqa: E402


def _ours(hook: object) -> bool:
    """A hook of gradwatch's (DeepSpeed registers forward hooks of its own)."""
    return (getattr(hook, "__module__", None) or type(hook).__module__).startswith("gradwatch")


def main(out: str, runs: str) -> None:
    for run in runs.split(","):
        run_dir = os.path.join(out, run)
        os.makedirs(run_dir, exist_ok=True)
        train(run_dir, None if run == "ddp" else run)
    sys.stdout.flush()
    torch.distributed.destroy_process_group()
    os._exit(0)  # see tests/dist_helpers.run_worker: gloo threads can abort interpreter finalisation


def train(out: str, zero_stage: str | None) -> None:
    deepspeed = None
    if zero_stage is not None:
        deepspeed_on_cpu()
        deepspeed = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                     "zero_optimization": {"stage": int(zero_stage)}, "zero_allow_untested_optimizer": True}  # fmt: skip
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", ddp_backend="gloo", seed=0, disable_tqdm=True,
        deepspeed=deepspeed,
    )  # fmt: skip
    watch = GradWatchCallback(flush_every=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[watch])
    trainer.train()
    rank = int(os.environ["RANK"])
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"world": torch.distributed.get_world_size(), "logged": logged,
                   "zero3": any(hasattr(p, "ds_id") for p in model.parameters()),  # the parameters partitioned
                   "hooks_left": sum(_ours(h) for m in model.modules() for h in m._forward_hooks.values())}, f)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:3])
