"""The TensorBoard writers gradwatch creates: ``SummaryWriter`` whose records are checksummed in C.

Every record of a TensorBoard event file carries the masked CRC32C of its header and of its
data. TensorBoard's ``RecordWriter`` computes them with its pure-Python CRC
(``tensorboard.compat.tensorflow_stub.pywrap_tensorflow``), ~0.1 us a byte, in the writer's
thread, which holds the GIL meanwhile: the training thread waits for it. A flush of a 9-layer
MLP writes ~51 KB of scalars (~5 ms of checksums), 129 layers ~0.7 MB (~70 ms); measured, the
optimizer step right after an MLP's flush took 15.3 ms against 4.9 (benchmarks/RESULTS.md,
twenty-ninth session). With ``google-crc32c``'s C extension, the writers gradwatch creates
checksum their records with it instead: the same CRC32C, masked the same way, so the same
bytes on disk, ~1500x faster. Only gradwatch's own writers: a writer the user hands over (a
Lightning logger's, ``writer=``) is never touched, and nothing process-wide changes.
"""

from __future__ import annotations

import struct
from typing import Any

#: TensorBoard's (and TensorFlow's) mask of a record's CRC32C
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF


def summary_writer(logdir: str) -> Any:
    """A ``SummaryWriter`` for ``logdir`` as gradwatch opens its own: a deep queue, so that a
    flush's events never wait for the writer's thread (``flush_secs`` bounds how stale the files
    on disk can be), and its records checksummed in C where it can (:func:`checksum_in_c`)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=logdir, max_queue=1000, flush_secs=30)
    checksum_in_c(writer)
    return writer


def masked_crc32c(data: bytes, crc32c: Any) -> int:
    """TensorBoard's masked CRC32C of ``data``, the CRC itself from ``crc32c`` (a function of bytes)."""
    crc = crc32c(data) & _U32
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _U32


def checksum_in_c(writer: Any) -> bool:
    """Make ``writer`` (a torch ``SummaryWriter``: the ones gradwatch opens, or a user's who asks
    for it) checksum its records with ``google_crc32c``'s C extension, into the same bytes.
    Returns whether it does: False, leaving the writer as it was, without that extension or
    where the writer is not built as measured (torch's ``FileWriter`` over TensorBoard's
    ``EventFileWriter`` and ``RecordWriter``)."""
    try:
        import google_crc32c
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        return False
    if getattr(google_crc32c, "implementation", None) != "c":  # its pure-Python fallback is no faster
        return False
    try:
        record_writer = writer._get_file_writer().event_writer._async_writer._writer
    except AttributeError:
        return False
    if type(record_writer) is not RecordWriter:
        return False
    crc32c = google_crc32c.value
    out = record_writer._writer

    def write(data: bytes) -> None:
        # RecordWriter.write's layout: length, its masked CRC, the data, its masked CRC
        header = struct.pack("<Q", len(data))
        out.write(header + struct.pack("<I", masked_crc32c(header, crc32c)) + data
                  + struct.pack("<I", masked_crc32c(data, crc32c)))  # fmt: skip

    record_writer.write = write  # this instance only (the writer's thread calls it)
    return True
