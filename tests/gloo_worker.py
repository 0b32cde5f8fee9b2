"""The one entry point of every gloo test process: ``python -m tests.gloo_worker MODULE:FUNCTION rank
world port out_path *args`` runs ``FUNCTION(rank, world, *args)`` in an initialised gloo group and
writes its JSON (``dist_helpers.run_worker``). Tests start it through the ``gloo`` fixture."""

from __future__ import annotations

import importlib
import sys

from tests.dist_helpers import run_worker

if __name__ == "__main__":
    module, _, function = sys.argv[1].partition(":")
    scenario = getattr(importlib.import_module(module), function)
    args = sys.argv[6:]
    sys.argv = [sys.argv[0], *sys.argv[2:6]]  # rank world port out_path, as run_worker reads them
    run_worker(lambda rank, world: scenario(rank, world, *args))
