"""The one entry point of every gloo test process: ``python -m tests.gloo_worker MODULE:FUNCTION rank
world port out_path *args`` runs ``FUNCTION(rank, world, *args)`` in an initialised gloo group and
writes its JSON (``dist_helpers.run_worker``). Tests start it through the ``gloo`` fixture."""

from __future__ import annotations

import importlib
import os
import sys

from tests.dist_helpers import run_worker

#: "device-agnostic": the ranks take the accelerators' parameter path (``conftest.gloo_param_path``)
PARAM_PATH_VARIABLE = "GRADWATCH_TEST_PARAM_PATH"

def main(argv: list[str]) -> None:
    """``argv``: ``MODULE:FUNCTION rank world port out_path *args`` (the command line without the program)."""
    if os.environ.get(PARAM_PATH_VARIABLE) == "device-agnostic":
        import gradwatch.capture.param_stats as param_stats

        param_stats.CPU_FAST_PATH = False  # the accelerators' path, on CPU tensors (conftest.gloo_param_path)
    module, _, function = argv[0].partition(":")
    scenario = getattr(importlib.import_module(module), function)
    args = argv[5:]
    sys.argv = [sys.argv[0], *argv[1:5]]  # rank world port out_path, as run_worker reads them
    run_worker(lambda rank, world: scenario(rank, world, *args))


if __name__ == "__main__":
    main(sys.argv[1:])
