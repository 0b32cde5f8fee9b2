"""Running test workers as real gloo processes (CPU), and reading back what each rank wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(module: str, world: int, out_path: str, *args: str, timeout: float = 240,
          scenario: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Run ``python -m module [scenario] rank world port out_path *args`` in ``world`` processes;
    return each rank's JSON. (Tests use the ``gloo`` fixture: ``tests.gloo_worker`` with a scenario.)

    Fails with every rank's output when a process exits non-zero (a crash, an abort,
    a hang past ``timeout``).
    """
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *([scenario] if scenario else []), str(rank), str(world), str(port),
             out_path, *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for rank in range(world)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append("TIMEOUT")
    codes = [p.returncode for p in procs]
    assert all(code == 0 for code in codes), f"exit codes {codes}\n" + "\n---\n".join(logs)[-6000:]
    results = []
    for rank in range(world):
        with open(f"{out_path}.{rank}") as f:
            results.append(json.load(f))
    return results


def run_worker(body: Callable[[int, int], dict[str, Any]]) -> None:
    """The ``__main__`` of a worker: init gloo, run ``body(rank, world)``, write its JSON, exit.

    The process ends with ``os._exit`` after destroying the process group: gloo's
    worker threads can otherwise meet interpreter finalisation and abort the process
    ("terminate called without an active exception") after the test's work is done.
    """
    import torch.distributed as dist

    rank, world, port, out_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = body(rank, world)
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(result, f)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
