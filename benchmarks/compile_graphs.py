"""Graphs and graph breaks of real models compiled whole, with gradwatch against the same model without it.

    python benchmarks/compile_graphs.py            # every case (about two minutes on 2 CPU cores)
    python benchmarks/compile_graphs.py llama      # the cases whose name contains "llama"
    python benchmarks/compile_graphs.py mlp encoder  # the shape regimes: static, dynamic=None, dynamic=True

Each case trains 12 steps unless it says (``aot_eager``; windows of 6, so steps 2-5 and 8-11 are unsampled) twice
in one process, unmonitored then monitored, after ``torch._dynamo.reset()``; dynamo's counters are
process-wide, so each run clears them first. "graphs" is ``unique_graphs``, "breaks" the sum of
``graph_break`` counts; "out_grad" how many monitored layers have an output-gradient statistic in
the last window (recorded inside the compiled code); "recompile limit hit" how many times dynamo
warned that a frame reached ``config.recompile_limit`` (and runs eagerly from then on).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import gradwatch_logger_at  # noqa: E402

from gradwatch import GradMonitor  # noqa: E402

Case = Callable[[], tuple[nn.Module, Callable[[], torch.Tensor], Callable[[object, torch.Tensor], torch.Tensor]]]


def _lm_loss(out: object, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), ids.reshape(-1))


def transformer_encoder():
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    model = nn.Sequential(nn.Linear(8, 32), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 4))
    return model, lambda: torch.randn(4, 6, 8), lambda out, x: out.square().mean()


def llama(use_cache: bool) -> Case:
    def build():
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=100, max_position_embeddings=32, use_cache=use_cache)  # fmt: skip
        return LlamaForCausalLM(config), lambda: torch.randint(0, 100, (2, 16)), _lm_loss

    return build


def gpt2(use_cache: bool) -> Case:
    def build():
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, use_cache=use_cache)
        return GPT2LMHeadModel(config), lambda: torch.randint(0, 100, (2, 16)), _lm_loss

    return build


def mlp_batches(sizes: tuple[int, ...]) -> Case:
    """An MLP fed batches whose size cycles through ``sizes`` (a new shape at each of the first steps)."""

    def build():
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        step = iter(range(1 << 30))
        return model, lambda: torch.randn(sizes[next(step) % len(sizes)], 8), lambda out, x: out.square().mean()

    return build


def encoder_lengths(lengths: tuple[int, ...]) -> Case:
    """The TransformerEncoder case fed sequences whose length cycles through ``lengths``."""

    def build():
        model, _, loss_of = transformer_encoder()
        step = iter(range(1 << 30))
        return model, lambda: torch.randn(4, lengths[next(step) % len(lengths)], 8), loss_of

    return build


class _LimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings (a frame sent back to eager)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "recompile_limit" in record.getMessage():
            self.hits += 1


def resnet18():
    """ResNet-18 as torchvision lays it out (benchmarks/workloads.py: BatchNorm, in-place ReLU, residual adds)."""
    from benchmarks.workloads import resnet18_model

    return resnet18_model(classes=10), lambda: torch.randn(2, 3, 32, 32), lambda out, x: out.square().mean()


def run(build: Case, monitored: bool, steps: int = 12, dynamic: bool | None = None,
        fullgraph: bool = False, regional: bool = False) -> dict[str, object]:  # fmt: skip
    """``regional``: each block of the model's first ``nn.ModuleList`` compiled (``block.compile()``), not the model."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, batch, loss_of = build()
    monitor = GradMonitor(model, flush_every=6) if monitored else None
    if regional:
        blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
        for block in blocks:
            block.compile(backend="aot_eager", dynamic=dynamic, fullgraph=fullgraph)
        compiled = model
    else:
        compiled = torch.compile(model, backend="aot_eager", dynamic=dynamic, fullgraph=fullgraph)
    limit = _LimitHits()
    logging.getLogger("torch._dynamo").addHandler(limit)
    try:
        for _ in range(steps):
            x = batch()
            loss_of(compiled(x), x).backward()
            if monitor is not None:
                monitor.step()
            model.zero_grad()
    except Exception as exc:  # fullgraph=True refused: say so in the table
        if not fullgraph:
            raise
        if monitor is not None:
            monitor.close()
        return {"graphs": f"fails ({type(exc).__name__})", "breaks": "-", "limit": limit.hits}
    finally:
        logging.getLogger("torch._dynamo").removeHandler(limit)
    result: dict[str, object] = {"graphs": counters["stats"]["unique_graphs"],
                                 "breaks": sum(counters["graph_break"].values()), "limit": limit.hits}  # fmt: skip
    if monitor is not None:
        window = monitor.last_window
        result["out_grad"] = f"{int(np.isfinite(window.out_grad_norm).any(axis=0).sum())}/{len(window.layers)}"
        monitor.close()
    return result


def hf_trainer(monitored: bool, use_cache: bool = False) -> dict[str, object]:
    """TrainingArguments(torch_compile=True) on a tiny GPT-2 (the Trainer sets the model's use_cache from
    its arguments: False by default)."""
    import transformers

    from gradwatch.hf import GradWatchCallback

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    data = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))} for _ in range(32)]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, max_steps=12, per_device_train_batch_size=2, report_to=[],
                                              torch_compile=True, torch_compile_backend="aot_eager", use_cpu=True,
                                              save_strategy="no", logging_strategy="no", use_cache=use_cache)  # fmt: skip
        callbacks = [GradWatchCallback(flush_every=6)] if monitored else []
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


CASES: dict[str, Callable[[bool], dict[str, object]]] = {
    "nn.TransformerEncoder": lambda m: run(transformer_encoder, m),
    "nn.TransformerEncoder, fullgraph=True": lambda m: run(transformer_encoder, m, fullgraph=True),
    "ResNet-18 (torchvision's layout)": lambda m: run(resnet18, m),
    "ResNet-18, fullgraph=True": lambda m: run(resnet18, m, fullgraph=True),
    "GPT-2 (tiny), use_cache=False, fullgraph=True": lambda m: run(gpt2(False), m, fullgraph=True),
    "Llama (tiny), use_cache=False, fullgraph=True": lambda m: run(llama(False), m, fullgraph=True),
    "GPT-2 (tiny), use_cache=True, fullgraph=True": lambda m: run(gpt2(True), m, fullgraph=True),
    "Llama (tiny), use_cache=False": lambda m: run(llama(False), m),
    "Llama (tiny), use_cache=True": lambda m: run(llama(True), m),
    "GPT-2 (tiny), use_cache=False": lambda m: run(gpt2(False), m),
    "GPT-2 (tiny), use_cache=True": lambda m: run(gpt2(True), m),
    "GPT-2 (tiny), use_cache=True, regional (each block compiled)": lambda m: run(gpt2(True), m, regional=True),
    "Llama (tiny), use_cache=True, fullgraph=True": lambda m: run(llama(True), m, fullgraph=True),
    "HF Trainer, torch_compile=True, GPT-2": hf_trainer,
    "HF Trainer, torch_compile=True, use_cache=True, GPT-2": lambda m: hf_trainer(m, use_cache=True),
    "MLP, dynamic=False, 5 batch sizes, 60 steps": lambda m: run(mlp_batches((8, 16, 24, 32, 40)), m, 60, False),
    "MLP, dynamic=None, batch sizes 8/16/24/32": lambda m: run(mlp_batches((8, 16, 24, 32)), m, 24),
    "MLP, dynamic=True, batch sizes 8/16/24/32": lambda m: run(mlp_batches((8, 16, 24, 32)), m, 24, True),
    "TransformerEncoder, dynamic=None, lengths 4/6/9/12": lambda m: run(encoder_lengths((4, 6, 9, 12)), m, 24),
    "TransformerEncoder, dynamic=False, lengths 4/6/9": lambda m: run(encoder_lengths((4, 6, 9)), m, 24, False),
}


def main(argv: list[str]) -> None:
    with gradwatch_logger_at(logging.ERROR):
        _main(argv)


def _main(argv: list[str]) -> None:
    print(f"torch {torch.__version__}, aot_eager, 12 steps, windows of 6\n")
    print("| case | graphs without / with gradwatch | recompile limit hit without / with "
          "| graph breaks without / with | layers with out_grad_norm |")
    print("|---|---|---|---|---|")
    for name, case in CASES.items():
        if argv and not any(a.lower() in name.lower() for a in argv):
            continue
        base, mon = case(False), case(True)
        print(f"| {name} | {base['graphs']} / {mon['graphs']} | {base.get('limit', '-')} / {mon.get('limit', '-')} | "
              f"{base['breaks']} / {mon['breaks']} | {mon.get('out_grad', '-')} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
