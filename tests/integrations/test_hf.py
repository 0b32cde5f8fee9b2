"""GradWatchCallback with the real Hugging Face Trainer (a tiny GPT-2 built from a config, no downloads)."""

from __future__ import annotations

import glob
import logging
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gradwatch.hf import GradWatchCallback  # noqa: E402

from ..conftest import read_scalars  # noqa: E402

LAYERS = ("transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "transformer.ln_f")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _RawNorms(transformers.TrainerCallback):
    """Per-layer grad_norm from p.grad at on_pre_optimizer_step, keyed by the step the Trainer logs it at."""

    def __init__(self) -> None:
        self.norms: dict[int, dict[str, float]] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms[state.global_step + 1] = {
            name: float(torch.linalg.vector_norm(torch.cat(
                [p.grad.reshape(-1).double() for p in model.get_submodule(name).parameters(recurse=False)])))
            for name in LAYERS
        }  # fmt: skip


class _RawOutNorms(transformers.TrainerCallback):
    """Per-layer out_grad_norm from gradients retained by this callback's own forward hooks."""

    def __init__(self) -> None:
        self.norms: dict[int, dict[str, float]] = {}
        self.retained = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from ..reference import RetainedOutputs

        self.layers = [name for name in LAYERS if name in dict(model.named_modules())]  # the model's blocks
        self.retained = RetainedOutputs(model, self.layers)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.norms[state.global_step + 1] = {name: self.retained.norm(name) for name in self.layers}
        self.retained.clear()


def _train(tmp_path, callbacks, max_grad_norm, accumulation=1, steps=6, report_to=(), order=None, blocks=2, **extra):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=blocks, n_head=2,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, learning_rate=0.0,
        max_grad_norm=max_grad_norm, gradient_accumulation_steps=accumulation, logging_steps=1,
        report_to=list(report_to), use_cpu=True, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
        **extra,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks)
    if order is not None:  # reorder the Trainer's callbacks (by class name): the order they run in
        handler = trainer.callback_handler
        handler.callbacks.sort(key=lambda c: order.index(type(c).__name__) if type(c).__name__ in order else -1)
    trainer.train()
    return trainer, model


def test_statistics_are_of_the_gradients_before_clipping_at_the_trainers_steps(tmp_path):
    reference = _RawNorms()
    _train(tmp_path / "reference", [reference], max_grad_norm=0.0)  # no clipping: the raw gradients
    watch = GradWatchCallback(flush_every=4)
    trainer, model = _train(tmp_path / "clipped", [watch], max_grad_norm=0.5)
    scalars = read_scalars(str(tmp_path / "clipped" / "gradwatch"))
    for name in LAYERS:
        got = scalars[f"gradwatch/grad_norm/{name}"]
        assert sorted(got) == list(range(1, 7))
        for step, value in got.items():
            assert value == pytest.approx(reference.norms[step][name], rel=1e-4), (name, step)
    # the clip really changed the gradients the optimizer saw: pre-clip norms are above 0.5
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    assert sorted(logged) == list(range(1, 7)) and min(logged.values()) > 0.5
    for step, value in logged.items():  # the Trainer's own logged (pre-clip) norm at the same step
        assert scalars["gradwatch/global/grad_norm"][step] == pytest.approx(value, rel=1e-4)
    assert all(not m._forward_hooks for m in model.modules())  # hooks removed when training ends
    assert "clip_grad_norm_" not in trainer.accelerator.__dict__  # and the wrapper too


@pytest.mark.slow
def test_torch_compile_records_every_statistic(tmp_path):
    import torch._dynamo

    # One block (dynamo's trace grows with the blocks it unrolls; the statistics do not need two).
    reference = _RawOutNorms()
    _train(tmp_path / "eager", [reference], max_grad_norm=1.0, steps=4, blocks=1)
    torch._dynamo.reset()
    watch = GradWatchCallback(flush_every=2, detail="full")
    _train(tmp_path / "compiled", [watch], max_grad_norm=1.0, steps=4, blocks=1, torch_compile=True,
           torch_compile_backend="aot_eager")  # fmt: skip
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the Trainer ran compiled code
    scalars = read_scalars(str(tmp_path / "compiled" / "gradwatch"))
    for step, layers in reference.norms.items():
        for name, value in layers.items():
            assert scalars[f"gradwatch/out_grad_norm/{name}"][step] == pytest.approx(value, rel=1e-4), (name, step)
    assert sorted(scalars["gradwatch/dead_fraction/transformer.h.0.attn.c_attn"]) == [2, 4]
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_model_compiled_fullgraph_with_the_kv_cache_on_records_every_statistic_at_the_baselines_graphs(caplog,
                                                                                                     monkeypatch):
    # With use_cache=True a tensor hook in the compiled frame trips a dynamo bug that dropped the
    # whole-model graph and failed fullgraph=True (docs/reference.md); compiled taps then hand the
    # output through an autograd function instead. out_grad_norm against an unmonitored eager twin's
    # retained output gradients; graphs against the same model compiled without gradwatch. The
    # output statistics run in the opaque op at run time on sampled steps (capture/host_branch.py;
    # torch.cond, which compiled taps used elsewhere until the twentieth session, cannot be traced
    # in that frame), not masked inside the graph at every step.
    import numpy as np

    from gradwatch import GradMonitor

    from ..compile.test_compile import _count_statistics_at_run_time
    from ..reference import RetainedOutputs

    computed = _count_statistics_at_run_time(monkeypatch)

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, use_cache=True,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip

    def train(monitored: bool, compiled: bool, names: list[str] = ()) -> tuple[list, object]:
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        model.config.use_cache = True
        monitor = GradMonitor(model, flush_every=3) if monitored else None
        retained = RetainedOutputs(model, list(names))
        forward = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        result, batches = [], torch.Generator().manual_seed(1)
        for _ in range(3):
            retained.clear()
            ids = torch.randint(0, 64, (2, 8), generator=batches)
            logits = forward(ids).logits  # fullgraph: a graph break would raise here
            torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1)).backward()
            result.append([retained.norm(n) for n in names])
            if monitor is not None:
                monitor.step()
            model.zero_grad()
        if monitor is not None:
            monitor.close()
            result.append(monitor.last_window)
        assert not counters["graph_break"]
        return result, counters["stats"]["unique_graphs"]

    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        _, baseline_graphs = train(monitored=False, compiled=True)
        monitored, graphs = train(monitored=True, compiled=True)
        window = monitored[-1]
        expected, _ = train(monitored=False, compiled=False, names=window.layers)
    assert graphs == baseline_graphs
    sampled = np.flatnonzero(window.sampled)
    assert len(sampled) and np.isfinite(window.out_grad_norm[sampled]).all()
    assert computed["values"] == len(sampled) * len(window.layers)  # once per layer and sampled step
    np.testing.assert_allclose(window.out_grad_norm[sampled], np.array([expected[k] for k in sampled]), rtol=1e-5)
    assert not [r for r in caplog.records if "use_cache" in r.getMessage()]
    torch._dynamo.reset()


def test_gradient_accumulation_gives_one_record_per_optimizer_step(tmp_path):
    watch = GradWatchCallback(flush_every=5)
    trainer, _ = _train(tmp_path, [watch], max_grad_norm=1.0, accumulation=2, steps=5)
    scalars = read_scalars(str(tmp_path / "gradwatch"))
    assert sorted(scalars["gradwatch/grad_norm/transformer.wte"]) == [1, 2, 3, 4, 5]
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    for step, value in logged.items():
        assert scalars["gradwatch/global/grad_norm"][step] == pytest.approx(value, rel=1e-4)


@pytest.mark.parametrize("gradwatch_first", [False, True], ids=["tensorboard-callback-first", "gradwatch-first"])
def test_writes_into_the_trainers_tensorboard_run_one_file_no_thread_left(tmp_path, gradwatch_first):
    import threading

    pytest.importorskip("tensorboard")
    watch = GradWatchCallback(flush_every=4)
    order = ["GradWatchCallback", "TensorBoardCallback"] if gradwatch_first else ["TensorBoardCallback", "GradWatchCallback"]
    before = set(threading.enumerate())
    _train(tmp_path, [watch], max_grad_norm=1.0, report_to=["tensorboard"], order=order)
    files = glob.glob(str(tmp_path / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(files) == 1  # one event file: the Trainer's own TensorBoard run, gradwatch's scalars in it
    scalars = read_scalars(os.path.dirname(files[0]))
    assert sorted(scalars["gradwatch/grad_norm/transformer.wte"]) == list(range(1, 7))  # the last flush too
    assert "train/loss" in scalars
    assert not os.path.exists(tmp_path / "gradwatch")
    left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], left  # no writer thread left running after train()


def test_a_callback_reused_for_another_train_starts_fresh(tmp_path):
    from gradwatch import HealthConfig

    config = HealthConfig(stop_on=frozenset({"exploding"}), exploding_abs_norm=1e-6)  # every step "explodes"
    watch = GradWatchCallback(flush_every=2, config=config)
    first, _ = _train(tmp_path / "a", [watch], max_grad_norm=1.0, steps=20)
    assert first.state.global_step == 1 and watch.alerts
    watch.config = HealthConfig()  # the same callback object, now without the stopping rule
    second, _ = _train(tmp_path / "b", [watch], max_grad_norm=1.0, steps=6)
    assert second.state.global_step == 6  # not stopped by the first run's stop
    assert watch.alerts == []  # nothing carried over


def test_training_that_raises_leaves_no_hook_and_no_wrapper(tmp_path):
    watch = GradWatchCallback(flush_every=2)
    trainers = []

    class FailAtTheFourthForward(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from gradwatch.integrations.hf import _find_trainer

            trainers.append(_find_trainer(watch))
            calls = [0]

            def fail(module, args):
                calls[0] += 1
                if calls[0] == 4:
                    raise RuntimeError("boom")

            model.transformer.h[0].register_forward_pre_hook(fail)

    with pytest.raises(RuntimeError, match="boom"):
        _train(tmp_path, [FailAtTheFourthForward(), watch], max_grad_norm=1.0, steps=6)
    trainer = trainers[0]
    assert watch.monitor is None
    assert all(not m._forward_hooks for m in trainer.model.modules())
    assert "clip_grad_norm_" not in trainer.accelerator.__dict__ and "training_step" not in trainer.__dict__


def test_stop_on_stops_training_through_the_control():
    from gradwatch import HealthConfig

    config = HealthConfig(stop_on=frozenset({"exploding"}), exploding_abs_norm=1e-6)  # every step "explodes"
    watch = GradWatchCallback(flush_every=2, config=config)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trainer, _ = _train(tmp, [watch], max_grad_norm=1.0, steps=20)
    assert trainer.state.global_step == 1  # stopped at the first step: the model's norm is judged every step
    assert any(a.kind == "exploding" for a in watch.alerts)


def test_import_gradwatch_imports_neither_transformers_nor_lightning_nor_inductor():
    # Inductor (~2 s to import) is loaded by the user's first compile; gradwatch's ops hook into its
    # code generation only once it is (gradwatch/_compat/inductor.py).
    import subprocess
    import sys

    code = ("import sys, gradwatch; print(sorted(m for m in ('transformers', 'accelerate', 'lightning', "
            "'pytorch_lightning', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture(scope="module")
def torchrun_trainers(tmp_path_factory):
    """One torchrun (2 CPU processes, gloo) of ``hf_worker.py`` for the distributed Trainer tests:
    DDP, then DeepSpeed ZeRO 2 and 3 where deepspeed is installed (one launch: ~10 s less each),
    once per test run (shared by the xdist workers)."""
    import importlib.util
    import subprocess
    import sys

    from ..dist_helpers import ROOT, built_once_per_run, free_port

    def launch(out):
        runs = ["ddp"] + (["2", "3"] if importlib.util.find_spec("deepspeed") is not None else [])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), os.path.join(ROOT, "tests", "integrations", "hf_worker.py"), str(out), ",".join(runs)]  # fmt: skip
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        (out / "stderr.txt").write_text(result.stderr)

    return built_once_per_run(tmp_path_factory, "hf_torchrun", launch)


def _ranks(out) -> list[dict]:
    import json

    return [json.load(open(out / f"rank{r}.json")) for r in range(2)]


@pytest.mark.slow
def test_torchrun_two_cpu_processes_rank_zero_writes(torchrun_trainers):
    out = torchrun_trainers / "ddp"
    ranks = _ranks(out)
    assert all(r["world"] == 2 and r["hooks_left"] == 0 for r in ranks)
    files = glob.glob(str(out / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(files) == 1  # only rank 0 wrote
    scalars = read_scalars(str(out / "gradwatch"))
    logged = {int(k): v for k, v in ranks[0]["logged"].items()}
    assert sorted(scalars["gradwatch/global/grad_norm"]) == sorted(logged) == [1, 2, 3, 4]
    for step, value in logged.items():  # DDP-averaged gradients, as the Trainer logs them
        assert scalars["gradwatch/global/grad_norm"][step] == pytest.approx(value, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["2", "3"])
def test_deepspeed_zero_through_the_trainer_records_the_gradient_it_clips(torchrun_trainers, stage):
    # accelerate runs engine.backward() and engine.step() inside accelerator.backward(); ZeRO's
    # reduced gradient exists only between them, where the callback records (it wraps engine.step).
    # ZeRO 2 keeps whole parameters, ZeRO 3 partitions them too.
    pytest.importorskip("deepspeed")
    root = torchrun_trainers
    assert "no parameter had a .grad" not in (root / "stderr.txt").read_text()
    ranks = _ranks(root / stage)
    assert all(r["world"] == 2 and r["hooks_left"] == 0 and r["zero3"] == (stage == "3") for r in ranks)
    scalars = read_scalars(str(root / stage / "gradwatch"))
    logged = {int(k): v for k, v in ranks[0]["logged"].items()}  # DeepSpeed's own global norm
    assert sorted(scalars["gradwatch/global/grad_norm"]) == sorted(logged) == [1, 2, 3, 4]
    for step, value in logged.items():
        assert scalars["gradwatch/global/grad_norm"][step] == pytest.approx(value, rel=1e-5), step


def _checkpointed_run(out, watch, steps, resume=None):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=2, learning_rate=0.0, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="steps", save_steps=4, seed=0, data_seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=_Tokens(),
                                   callbacks=[watch])  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_the_callbacks_state_round_trips_through_a_trainer_checkpoint(tmp_path):
    import json

    from gradwatch import HealthConfig

    config = HealthConfig(exploding_abs_norm=1e-6)  # every step's norm is "exploding": one condition
    first = GradWatchCallback(flush_every=2, config=config)
    _checkpointed_run(tmp_path, first, steps=4)
    before = [a for a in first.alerts]
    assert before and all(a.step <= 4 for a in before)
    with open(tmp_path / "checkpoint-4" / "trainer_state.json") as f:
        saved = json.load(f)["stateful_callbacks"]["GradWatchCallback"]
    assert saved["attributes"]["restored_state"]["tracker"]["active"]  # the condition is in the checkpoint
    assert saved["args"]["config"]["exploding_abs_norm"] == 1e-6

    resumed = GradWatchCallback(flush_every=2, config=config)
    states = []
    original = GradWatchCallback.on_train_begin

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        states.append(self.monitor.state_dict())

    GradWatchCallback.on_train_begin = spy
    try:
        _checkpointed_run(tmp_path, resumed, steps=8, resume=str(tmp_path / "checkpoint-4"))
    finally:
        GradWatchCallback.on_train_begin = original
    restored = saved["attributes"]["restored_state"]
    # the detector state right after resuming is the checkpoint's
    assert json.loads(json.dumps(states[0]["checks"])) == restored["checks"]
    assert states[0]["tracker"]["active"] == restored["tracker"]["active"]
    # the condition that was active before the checkpoint is not a new onset after it
    assert [a for a in resumed.alerts if a.step > 4] == []
    assert [(a.kind, a.layer, a.step) for a in resumed.alerts] == [(a.kind, a.layer, a.step) for a in before]


def test_without_the_checkpoints_state_the_same_resume_raises_new_onsets(tmp_path):
    # the control of the test above: a fresh callback state on resume raises the condition again
    from gradwatch import HealthConfig

    config = HealthConfig(exploding_abs_norm=1e-6)
    _checkpointed_run(tmp_path, GradWatchCallback(flush_every=2, config=config), steps=4)
    state_file = tmp_path / "checkpoint-4" / "trainer_state.json"
    import json

    state = json.loads(state_file.read_text())
    state["stateful_callbacks"]["GradWatchCallback"]["attributes"]["restored_state"] = {}
    state_file.write_text(json.dumps(state))
    resumed = GradWatchCallback(flush_every=2, config=config)
    _checkpointed_run(tmp_path, resumed, steps=8, resume=str(tmp_path / "checkpoint-4"))
    assert [a for a in resumed.alerts if a.step > 4]
