"""Running test workers as real gloo processes (CPU), and reading back what each rank wrote."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def built_once_per_run(tmp_path_factory: Any, name: str, build: Callable[[Any], None]) -> Any:
    """A folder that ``build(folder)`` fills once per test run, shared by the run's xdist workers:
    the first worker to ask builds it under a file lock, the others wait for it and reuse it (a
    module-scoped fixture would otherwise run once in each worker that runs one of its tests).
    Without xdist, a folder of the session's own. A build that raises leaves nothing behind, so the
    next worker that asks builds it again and fails the same way."""
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # every worker's basetemp is a folder of the run's
    folder = root / name
    with FileLock(str(folder) + ".lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            (folder / ".built").touch()
    return folder


#: Modules imported once by the fork server the gloo processes are forked from: importing torch
#: took 3-5 s per process on the 2-core CI machine, for every rank of every distributed test.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "gradwatch",
            "tests.gloo_worker"]  # fmt: skip
_context: Any = None


def _fork_server() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _child(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """A forked rank: the test's environment and working directory, its output into ``log_path``, then
    ``python -m tests.gloo_worker argv`` as it would run (``run_worker`` ends the process)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    from tests import gloo_worker

    gloo_worker.main(argv)


def spawn(module: str, world: int, out_path: str, *args: str, timeout: float = 240,
          scenario: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Run ``python -m module [scenario] rank world port out_path *args`` in ``world`` processes;
    return each rank's JSON. (Tests use the ``gloo`` fixture: ``tests.gloo_worker`` with a scenario.)
    ``tests.gloo_worker`` ranks are forked from a server that imported torch once (each is still a
    fresh process with the test's environment); any other module runs as its own interpreter.

    Fails with every rank's output when a process exits non-zero (a crash, an abort,
    a hang past ``timeout``).
    """
    for attempt in range(2):
        port = free_port()
        argvs = [[*([scenario] if scenario else []), str(rank), str(world), str(port), out_path, *args]
                 for rank in range(world)]  # fmt: skip
        if module == "tests.gloo_worker":
            logs = _run_forked(argvs, out_path, timeout)
        else:
            logs = _run_interpreters(module, argvs, timeout)
        codes = [code for code, _ in logs]
        # The suite's xdist workers start groups side by side: another one may have bound the port
        # between free_port() and this group's store. Once more on a new port, then fail.
        if attempt or all(code == 0 for code in codes) or not any(_port_taken(log) for _, log in logs):
            break
    assert all(code == 0 for code in codes), f"exit codes {codes}\n" + "\n---\n".join(log for _, log in logs)[-6000:]
    results = []
    for rank in range(world):
        with open(f"{out_path}.{rank}") as f:
            results.append(json.load(f))
    return results


def _port_taken(log: str) -> bool:
    return "address already in use" in log.lower() or "eaddrinuse" in log.lower()


def _run_forked(argvs: list[list[str]], out_path: str, timeout: float) -> list[tuple[int | None, str]]:
    context = _fork_server()
    env = dict(os.environ)
    paths = [f"{out_path}.log{rank}" for rank in range(len(argvs))]
    procs = [context.Process(target=_child, args=(argv, env, path)) for argv, path in zip(argvs, paths)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    timed_out = any(p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    logs = []
    for p, path in zip(procs, paths):  # a killed rank's exit code is negative
        with open(path, errors="replace") as f:
            logs.append((p.exitcode, f.read() + ("\nTIMEOUT" if timed_out else "")))
    return logs


def _run_interpreters(module: str, argvs: list[list[str]], timeout: float) -> list[tuple[int | None, str]]:
    procs = [
        subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for argv in argvs
    ]
    logs = []
    for p in procs:
        try:
            out = p.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out = p.communicate()[0] + "\nTIMEOUT"
        logs.append((p.returncode, out))
    return logs


def deepspeed_on_cpu() -> None:
    """Prepare DeepSpeed for a test rank: its CPU accelerator, and none of its C++ ops built.

    On the CPU accelerator ``deepspeed.init_distributed`` compiles a shared-memory collective op
    with ninja (``comm/torch.py: build_shm_op``) whenever the op's build hash changes, ~40 s a time
    here (measured with a traceback dump of a slow rank: the suite's DeepSpeed test took 42-61 s
    instead of 5 in 4 of ~20 runs). The tests' collectives are gloo's; the op is an optional fast
    path DeepSpeed skips where it is not compatible, which an empty compatibility table says (the
    table is only read for that op; probing it runs compiler subprocesses too).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    deepspeed.ops.__dict__.setdefault("__compatible_ops__", {})


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
