"""GradWatch with real Trainer runs on CPU."""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from gradwatch import GradWatch, HealthConfig  # noqa: E402

from ..conftest import read_scalars  # noqa: E402
from ..lightning_app.model import RankSplitModel, Regressor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trainer(tmp_path, callbacks, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=30,
        logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    defaults.update(kwargs)
    return L.Trainer(callbacks=callbacks, **defaults)


def test_one_record_per_optimizer_step_and_names_relative_to_module(tmp_path):
    watch = GradWatch(flush_every=7, detail="full")
    trainer = _trainer(tmp_path, [watch], val_check_interval=10, limit_val_batches=2, num_sanity_val_steps=2)
    trainer.fit(Regressor())
    scalars = read_scalars(str(tmp_path / "run"))
    for layer in ("net.0", "net.2", "net.4"):
        assert sorted(scalars[f"gradwatch/grad_norm/{layer}"]) == list(range(30))
        assert sorted(scalars[f"gradwatch/out_grad_norm/{layer}"]) == list(range(30))
    assert sorted(scalars["gradwatch/global/grad_norm"]) == list(range(30))
    assert watch.monitor is None  # detached at the end of fit
    model = trainer.lightning_module
    assert all(not m._forward_hooks for m in model.modules())


def test_accumulate_grad_batches_records_each_optimizer_step_once(tmp_path):
    trainer = _trainer(tmp_path, [GradWatch(flush_every=4)], max_steps=10, accumulate_grad_batches=3, limit_val_batches=0)
    trainer.fit(Regressor())
    scalars = read_scalars(str(tmp_path / "run"))
    assert sorted(scalars["gradwatch/grad_norm/net.0"]) == list(range(10))


def test_bf16_mixed_gives_finite_statistics(tmp_path):
    trainer = _trainer(
        tmp_path, [GradWatch(flush_every=5, detail="full")], max_steps=10, precision="bf16-mixed", limit_val_batches=0
    )
    trainer.fit(Regressor())
    scalars = read_scalars(str(tmp_path / "run"))
    values = [v for tag, s in scalars.items() if tag.startswith("gradwatch/") and "norm" in tag for v in s.values()]
    assert values and all(torch.isfinite(torch.tensor(values)))
    assert len(scalars["gradwatch/out_grad_norm/net.2"]) == 10


def test_checkpoint_resume_restores_state_and_continues_steps(tmp_path):
    first = GradWatch(flush_every=5)
    trainer = _trainer(tmp_path / "a", [first], max_steps=20, limit_val_batches=0)
    model = Regressor()
    trainer.fit(model)
    ckpt = str(tmp_path / "a.ckpt")
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    state = next(v for k, v in saved.items() if "GradWatch" in k)
    assert state["next_step"] == 20 and state["checks"]["steps_seen"] == 20

    second = GradWatch(flush_every=5)
    trainer2 = _trainer(tmp_path / "b", [second], max_steps=40, limit_val_batches=0)
    trainer2.fit(Regressor(), ckpt_path=ckpt)
    scalars = read_scalars(str(tmp_path / "b" / "run"))
    assert sorted(scalars["gradwatch/grad_norm/net.0"]) == list(range(20, 40))
    assert second.state_dict()["checks"]["steps_seen"] == 40


def test_dead_layer_logs_a_warning_naming_it(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        trainer = _trainer(tmp_path, [GradWatch(flush_every=10)], max_steps=20, limit_val_batches=0)
        trainer.fit(Regressor(dead_first_layer=True))
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dead_units" in m and "layer net.0" in m for m in messages), messages


def test_stop_on_sets_should_stop(tmp_path):
    watch = GradWatch(flush_every=5, config=HealthConfig(stop_on=frozenset({"dead_units"})))
    trainer = _trainer(tmp_path, [watch], max_steps=50, limit_val_batches=0)
    trainer.fit(Regressor(dead_first_layer=True))
    assert trainer.global_step < 50
    assert any(a.kind == "dead_units" for a in watch.alerts)


def test_own_writer_under_default_root_dir_without_any_logger(tmp_path):
    trainer = _trainer(tmp_path, [GradWatch(flush_every=5)], max_steps=5, logger=False, limit_val_batches=0)
    trainer.fit(Regressor())
    assert "gradwatch/grad_norm/net.0" in read_scalars(str(tmp_path / "lightning_logs" / "gradwatch"))


def test_pytorch_lightning_trainer_is_served_too(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")

    class PLRegressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(
        callbacks=[GradWatch(flush_every=5)], max_steps=10, accelerator="cpu", devices=1,
        logger=pl.loggers.TensorBoardLogger(str(tmp_path), name="pl", version=0),
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(PLRegressor(), torch.utils.data.DataLoader(torch.randn(200, 4), batch_size=10))
    assert sorted(read_scalars(str(tmp_path / "pl"))["gradwatch/grad_norm/net.0"]) == list(range(10))


@pytest.mark.slow
def test_ddp_spawn_two_processes_write_once_with_reduced_counters(tmp_path):
    trainer = _trainer(
        tmp_path, [GradWatch(flush_every=5)], strategy="ddp_spawn", devices=2, max_steps=10, limit_val_batches=0
    )
    trainer.fit(RankSplitModel())
    files = glob.glob(str(tmp_path / "run" / "**" / "events.out.tfevents.*"), recursive=True)
    gradwatch_files = [f for f in files if "gradwatch/grad_norm/gate" in read_scalars_file(f)]
    assert len(gradwatch_files) == 1  # only rank 0 wrote
    scalars = read_scalars(str(tmp_path / "run"))
    assert sorted(scalars["gradwatch/grad_norm/gate"]) == list(range(10))
    # Units 0-3 are dead on both ranks, units 4-7 only on rank 0: reduced across ranks, 4/16.
    assert scalars["gradwatch/dead_fraction/gate"] == {4: pytest.approx(0.25), 9: pytest.approx(0.25)}


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp1_fit_on_two_processes_records_the_whole_layers(tmp_path):
    # FSDP1 (use_orig_params=True, every Linear its own unit, FULL_SHARD) through Lightning's
    # FSDPStrategy on 2 CPU processes (tests/lightning_app/fsdp_fit.py says how it runs on CPU):
    # the user's layer names, and each layer's grad_norm that of the whole gradient as FSDP gathers it.
    import json

    cmd = [sys.executable, "-m", "tests.lightning_app.fsdp_fit", str(tmp_path)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert all(r["hooks_left"] == 0 for r in ranks)
    scalars = read_scalars(str(tmp_path / "run"))
    assert sorted(t for t in scalars if t.startswith("gradwatch/grad_norm/")) == [
        "gradwatch/grad_norm/net.0", "gradwatch/grad_norm/net.2", "gradwatch/grad_norm/net.4"]  # fmt: skip
    for step, whole in enumerate(ranks[0]["whole"]):
        assert whole == ranks[1]["whole"][step]
        for layer, norm in whole.items():
            assert scalars[f"gradwatch/grad_norm/{layer}"][step] == pytest.approx(norm, rel=1e-6), (step, layer)


def read_scalars_file(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.mark.slow
def test_lightning_cli_configures_the_callback(tmp_path):
    # In this process (LightningCLI parses the list it is given, as it parses sys.argv): a
    # subprocess would spend seconds importing torch and Lightning again.
    from tests.lightning_app.cli import LightningCLI, Regressor

    args = [
        "fit",
        "--trainer.callbacks+=gradwatch.GradWatch", "--trainer.callbacks.flush_every=10",
        "--trainer.callbacks.config.dead_fraction=0.9", "--trainer.callbacks.config.stop_on=[nonfinite]",
        "--trainer.max_steps=20", "--trainer.accelerator=cpu", "--trainer.devices=1",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
        f"--trainer.logger.save_dir={tmp_path}", "--trainer.logger.name=cli", "--trainer.logger.version=0",
        f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    cli = LightningCLI(Regressor, args=args)
    watch = [c for c in cli.trainer.callbacks if type(c).__name__ == "GradWatch"]
    assert len(watch) == 1 and watch[0].monitor is None  # closed at the end of fit
    scalars = read_scalars(str(tmp_path / "cli"))
    assert sorted(scalars["gradwatch/grad_norm/net.0"]) == list(range(20))
    # flush_every=10 came through: dead_fraction is written once per window, at steps 9 and 19
    assert sorted(scalars["gradwatch/dead_fraction/net.0"]) == [9, 19]


class _Reference(L.Callback):
    """Independent computation of grad_norm and out_grad_norm, unscaled, per optimizer step."""

    def __init__(self, scaler):
        self.scaler = scaler
        self.expected: dict[int, dict[str, tuple[float, float]]] = {}
        self.outputs: dict[str, list[torch.Tensor]] = {}

    def on_fit_start(self, trainer, pl_module):
        for name in ("net.0", "net.2"):
            module = pl_module.get_submodule(name)
            module.register_forward_hook(lambda m, a, out, n=name: self._keep(n, out))

    def _keep(self, name, out):
        if torch.is_grad_enabled():
            out.retain_grad()
            self.outputs.setdefault(name, []).append(out)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        scale = float(self.scaler.get_scale())
        fused_still_scaled = getattr(optimizer, "_step_supports_amp_scaling", False)
        result = {}
        for name in ("net.0", "net.2"):
            module = pl_module.get_submodule(name)
            flat = torch.cat([p.grad.reshape(-1).double() for p in module.parameters()])
            grad_norm = float(torch.linalg.vector_norm(flat)) / (scale if fused_still_scaled else 1.0)
            out_sq = sum(float(o.grad.double().pow(2).sum()) for o in self.outputs.get(name, []))
            result[name] = (grad_norm, out_sq**0.5 / scale)
        self.outputs.clear()
        self.expected[trainer.global_step] = result


@pytest.mark.parametrize("fused", [False, True], ids=["unscaled-by-lightning", "fused-adam-still-scaled"])
def test_16_mixed_with_gradscaler_reports_unscaled_values(tmp_path, fused):
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Model(Regressor):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3, fused=fused)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    reference = _Reference(scaler)
    trainer = _trainer(
        tmp_path, [reference, GradWatch(flush_every=4, detail="full")], max_steps=8, limit_val_batches=0,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )  # fmt: skip
    trainer.fit(Model())
    scalars = read_scalars(str(tmp_path / "run"))
    assert len(reference.expected) == 8
    for step, layers in reference.expected.items():
        for name, (grad_norm, out_norm) in layers.items():
            assert scalars[f"gradwatch/grad_norm/{name}"][step] == pytest.approx(grad_norm, rel=1e-3)
            assert scalars[f"gradwatch/out_grad_norm/{name}"][step] == pytest.approx(out_norm, rel=1e-3)


def test_detaches_when_training_raises(tmp_path):
    class Crashing(Regressor):
        def training_step(self, idx, batch_idx):
            if batch_idx == 6:
                raise RuntimeError("boom")
            return super().training_step(idx, batch_idx)

    watch = GradWatch(flush_every=4)
    model = Crashing()
    trainer = _trainer(tmp_path, [watch], max_steps=20, limit_val_batches=0)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model)
    assert watch.monitor is None
    assert all(not m._forward_hooks for m in model.modules())
    # the partial window (steps 4-5) was flushed on the way out
    assert sorted(read_scalars(str(tmp_path / "run"))["gradwatch/grad_norm/net.0"]) == list(range(6))


class _UpdateReference(L.Callback):
    """The update ratio of net.0 per optimizer step, from weight copies taken around the step."""

    def __init__(self):
        self.before = None
        self.ratios: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before = [p.detach().clone() for p in pl_module.net[0].parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        after = list(pl_module.net[0].parameters())
        change = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(after, self.before))
        norm = sum(float(b.double().square().sum()) for b in self.before)
        self.ratios[trainer.global_step - 1] = (change / norm) ** 0.5


def test_update_ratio_through_the_trainers_optimizer(tmp_path):
    reference = _UpdateReference()
    trainer = _trainer(tmp_path, [GradWatch(flush_every=5), reference], max_steps=10, limit_val_batches=0)
    trainer.fit(Regressor(lr=0.01))
    written = read_scalars(str(tmp_path / "run"))["gradwatch/update_ratio/net.0"]
    assert sorted(written) == [0, 1, 5, 6]  # two consecutive steps at the start of each window
    for step, value in written.items():
        assert value == pytest.approx(reference.ratios[step], rel=1e-3)


class _NoScaler:
    def get_scale(self):
        return 1.0


def test_fit_of_a_compiled_module_records_every_statistic(tmp_path):
    # trainer.fit(torch.compile(module)): Lightning compiles the module's forward and steps; the
    # reference is an uncompiled fit of the same module (lr=0: the same gradients at every step).
    reference = _Reference(_NoScaler())
    torch.manual_seed(0)
    _trainer(tmp_path / "eager", [reference], max_steps=6, limit_val_batches=0, logger=False).fit(Regressor(lr=0.0))
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled = torch.compile(Regressor(lr=0.0), backend="aot_eager")
    trainer = _trainer(tmp_path, [GradWatch(flush_every=3, detail="full")], max_steps=6, limit_val_batches=0)
    trainer.fit(compiled)
    scalars = read_scalars(str(tmp_path / "run"))
    for step, layers in reference.expected.items():
        for name, (grad_norm, out_norm) in layers.items():
            assert scalars[f"gradwatch/grad_norm/{name}"][step] == pytest.approx(grad_norm, rel=1e-4)
            assert scalars[f"gradwatch/out_grad_norm/{name}"][step] == pytest.approx(out_norm, rel=1e-4)
    assert sorted(scalars["gradwatch/dead_fraction/net.0"]) == [2, 5]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it really ran compiled code
    torch._dynamo.reset()


def test_a_callback_reused_for_another_fit_starts_fresh(tmp_path):
    watch = GradWatch(flush_every=5)
    _trainer(tmp_path / "a", [watch], max_steps=30, limit_val_batches=0).fit(Regressor(dead_first_layer=True))
    assert any(a.kind == "dead_units" and a.layer == "net.0" for a in watch.alerts)
    after_first = watch.state_dict()
    assert after_first["next_step"] == 30  # state_dict() after fit: what a checkpoint would hold
    healthy = Regressor()
    _trainer(tmp_path / "b", [watch], max_steps=30, limit_val_batches=0).fit(healthy)
    assert watch.alerts == []  # nothing of the dead first model's history or alerts
    assert sorted(read_scalars(str(tmp_path / "b" / "run"))["gradwatch/grad_norm/net.0"]) == list(range(30))
