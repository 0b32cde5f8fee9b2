"""GradWatch through every Lightning logger, read back with each tool's own reader."""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import struct

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402

from gradwatch import GradWatch  # noqa: E402

from ..conftest import read_scalars  # noqa: E402
from ..lightning_app.model import Regressor  # noqa: E402

LAYERS = ("net.0", "net.2", "net.4")
STEPS = 12


class _Reference(L.Callback):
    """Per-layer grad_norm from p.grad in on_before_optimizer_step (independent of gradwatch)."""

    def __init__(self) -> None:
        self.expected: dict[int, dict[str, float]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.expected[trainer.global_step] = {
            name: float(torch.linalg.vector_norm(torch.cat(
                [p.grad.reshape(-1).double() for p in pl_module.get_submodule(name).parameters()])))
            for name in LAYERS
        }  # fmt: skip


def _fit(tmp_path, logger) -> _Reference:
    reference = _Reference()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=logger, callbacks=[reference, GradWatch(flush_every=5)],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        limit_val_batches=0, default_root_dir=str(tmp_path), log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(Regressor())
    assert len(reference.expected) == STEPS
    return reference


def _check(series: dict[str, dict[int, float]], reference: _Reference) -> None:
    for name in LAYERS:
        got = series[f"gradwatch/grad_norm/{name}"]
        assert sorted(got) == list(range(STEPS)), name
        for step, value in got.items():
            assert value == pytest.approx(reference.expected[step][name], rel=1e-5), (name, step)
    assert sorted(series["gradwatch/global/grad_norm"]) == list(range(STEPS))


def _read_csv(path: str) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key.startswith("gradwatch/") and value != "":
                    series.setdefault(key, {})[int(row["step"])] = float(value)
    return series


def test_csv_logger(tmp_path):
    reference = _fit(tmp_path, CSVLogger(str(tmp_path), name="csv", version=0))
    _check(_read_csv(str(tmp_path / "csv" / "version_0" / "metrics.csv")), reference)


def test_tensorboard_and_csv_loggers_together(tmp_path):
    loggers = [TensorBoardLogger(str(tmp_path), name="tb", version=0), CSVLogger(str(tmp_path), name="csv", version=0)]
    reference = _fit(tmp_path, loggers)
    _check(read_scalars(str(tmp_path / "tb")), reference)
    _check(_read_csv(str(tmp_path / "csv" / "version_0" / "metrics.csv")), reference)
    # TensorBoard-only output went to the TensorBoard logger's folder, and nowhere else
    assert not glob.glob(str(tmp_path / "csv" / "**" / "events.out.tfevents.*"), recursive=True)


def test_mlflow_logger_with_a_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    logger = MLFlowLogger(experiment_name="gradwatch", tracking_uri=uri)
    reference = _fit(tmp_path, logger)
    client = MlflowClient(tracking_uri=uri)
    series = {}
    for key in [f"gradwatch/grad_norm/{name}" for name in LAYERS] + ["gradwatch/global/grad_norm"]:
        series[key] = {m.step: m.value for m in client.get_metric_history(logger.run_id, key)}
    _check(series, reference)


def _wandb_history(run_dir: str) -> list[dict]:
    """History rows of an offline W&B run, from its .wandb file (W&B's record log, its own protobufs)."""
    from wandb.proto import wandb_internal_pb2

    path = glob.glob(os.path.join(run_dir, "**", "run-*.wandb"), recursive=True)[0]
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    rows, pos, pending, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})  # fmt: skip
    return rows


def test_wandb_logger_offline_keeps_values_of_past_steps(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="gradwatch", save_dir=str(tmp_path), offline=True)
    reference = _fit(tmp_path, logger)
    import wandb

    wandb.finish()
    wandb.teardown()  # waits for W&B's core process to finish writing the run's file
    series: dict[str, dict[int, float]] = {}
    for row in _wandb_history(str(tmp_path / "wandb")):
        step = row.get("trainer/global_step")
        for key, value in row.items():
            if key.startswith("gradwatch/") and step is not None and not (isinstance(value, float) and math.isnan(value)):
                series.setdefault(key, {})[int(step)] = value
    # values of past steps arrive at flush time; WandbLogger logs them with trainer/global_step
    # as their step metric, so W&B keeps them (its own _step only grows)
    _check(series, reference)


class _PerOptimizerNorms(L.Callback):
    """Each optimizer's own layers' grad norms at each of its steps, from p.grad (independent)."""

    def __init__(self) -> None:
        self.norms: dict[str, dict[int, float]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, module in pl_module.named_modules():
            params = [p for p in module.parameters(recurse=False) if id(p) in mine]
            if params:
                flat = torch.cat([p.grad.reshape(-1).double() for p in params])
                self.norms.setdefault(name, {})[trainer.global_step] = float(torch.linalg.vector_norm(flat))


def test_several_optimizers_each_layer_at_its_own_optimizers_steps(tmp_path):
    from ..lightning_app.model import TinyGAN

    reference = _PerOptimizerNorms()
    watch = GradWatch(flush_every=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=16, logger=TensorBoardLogger(str(tmp_path), name="tb", version=0),
        callbacks=[reference, watch], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(TinyGAN())
    scalars = read_scalars(str(tmp_path / "tb"))
    layers = ["generator.0", "generator.2", "discriminator.0", "discriminator.2"]
    g_steps, d_steps = sorted(reference.norms["generator.0"]), sorted(reference.norms["discriminator.0"])
    assert len(g_steps) == len(d_steps) == 8 and not set(g_steps) & set(d_steps)  # interleaved steps
    for name in layers:
        written = scalars[f"gradwatch/grad_norm/{name}"]
        assert sorted(written) == sorted(reference.norms[name])  # at its own optimizer's steps only
        for step, value in written.items():
            assert value == pytest.approx(reference.norms[name][step], rel=1e-4), (name, step)
        assert f"gradwatch/update_ratio/{name}" in scalars  # each optimizer's own update ratio
        assert f"gradwatch/out_grad_norm/{name}" in scalars
    from gradwatch.sinks.tensorboard import LAYERS_TAG, parse_layers_markdown
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    tag = f"{LAYERS_TAG}/text_summary"
    texts = [parse_layers_markdown(t.tensor_proto.string_val[0].decode()) for t in events.Tensors(tag)]
    assert texts == [layers]  # one dashboard layout naming every optimizer's layers, written once
    assert watch.monitors == [] and all(not m._forward_hooks for m in trainer.lightning_module.modules())


def test_no_logger_writes_beside_lightning_logs_never_into_a_package_folder(tmp_path, monkeypatch):
    (tmp_path / "gradwatch").mkdir()  # as in a source checkout: the package folder
    monkeypatch.chdir(tmp_path)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, callbacks=[GradWatch(flush_every=5)],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0)  # fmt: skip
    trainer.fit(Regressor())
    assert not glob.glob(str(tmp_path / "gradwatch" / "**" / "*tfevents*"), recursive=True)
    assert "gradwatch/grad_norm/net.0" in read_scalars(str(tmp_path / "lightning_logs" / "gradwatch"))
