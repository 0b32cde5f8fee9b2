"""gradwatch's own TensorBoard writers checksum their records in C, into the bytes TensorBoard's writer makes."""

from __future__ import annotations

import glob
import os
import struct

import pytest
import torch
from torch import nn

from gradwatch import GradMonitor
from gradwatch.sinks.event_writer import summary_writer

google_crc32c = pytest.importorskip("google_crc32c")


def _records(path: str) -> list[tuple[bytes, int, bytes, int]]:
    """(header, its stored CRC, data, its stored CRC) of every record of an event file, parsed by hand."""
    with open(path, "rb") as f:
        blob = f.read()
    out, at = [], 0
    while at < len(blob):
        header = blob[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", blob[at + 8 : at + 12])
        data = blob[at + 12 : at + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[at + 12 + length : at + 16 + length])
        out.append((header, header_crc, data, data_crc))
        at += 16 + length
    return out


def _event_files(logdir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True))


def test_records_carry_the_checksums_tensorboard_s_own_crc_gives(tmp_path):
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # TensorBoard's, in Python
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    writer = summary_writer(str(tmp_path))
    record_writer = writer._get_file_writer().event_writer._async_writer._writer
    assert "write" in vars(record_writer)  # the C checksums are in use (this instance only)
    for step in range(30):
        writer.add_scalar("gradwatch/grad_norm/layer.with.a.long.name", step * 0.5, step)
    writer.add_text("gradwatch/alerts", "x" * 5000, 3)  # a record longer than a few bytes
    writer.close()
    (path,) = _event_files(str(tmp_path))
    records = _records(path)
    assert len(records) == 32  # the file version, 30 scalars, the text
    for header, header_crc, data, data_crc in records:
        assert header_crc == masked_crc32c(header) and data_crc == masked_crc32c(data)
    from tensorboard.util.tensor_util import make_ndarray

    values = [(e.step, float(make_ndarray(v.tensor))) for e in EventFileLoader(path).Load() for v in e.summary.value
              if v.tag == "gradwatch/grad_norm/layer.with.a.long.name"]  # fmt: skip (the loader makes scalars tensors)
    assert values == [(step, step * 0.5) for step in range(30)]


def test_a_monitor_s_own_writer_checksums_in_c_and_a_user_s_writer_is_left_alone(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    model = nn.Linear(4, 2)
    own = GradMonitor(model, logdir=str(tmp_path / "own"), flush_every=2)
    users = SummaryWriter(str(tmp_path / "users"))
    theirs = GradMonitor(nn.Linear(4, 2), writer=users, flush_every=2)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        own.step()
    own_writer = own._stages.outputs.tensorboard.writer
    assert "write" in vars(own_writer._get_file_writer().event_writer._async_writer._writer)
    assert "write" not in vars(users._get_file_writer().event_writer._async_writer._writer)
    own.close()
    theirs.close()
    users.close()


def test_the_helper_gives_a_lightning_logger_s_writer_the_same_checksums(tmp_path):
    # the reference's example: checksum_in_c(trainer.logger.experiment) with Lightning's TensorBoardLogger
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from gradwatch.sinks.event_writer import checksum_in_c

    loggers = pytest.importorskip("lightning.pytorch.loggers")
    writer = loggers.TensorBoardLogger(str(tmp_path)).experiment
    assert checksum_in_c(writer)
    writer.add_scalar("loss", 1.5, 0)
    writer.close()
    records = [r for path in _event_files(str(tmp_path)) for r in _records(path)]
    assert len(records) == 2
    assert all(hc == masked_crc32c(h) and dc == masked_crc32c(d) for h, hc, d, dc in records)
