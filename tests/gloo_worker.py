"""The one entry point of every gloo test process: ``python -m tests.gloo_worker MODULE:FUNCTION rank
world port out_path *args`` runs ``FUNCTION(rank, world, *args)`` in an initialised gloo group and
writes its JSON (``dist_helpers.run_worker``). Tests start it through the ``gloo`` fixture."""

from __future__ import annotations

import importlib
import sys

from tests.dist_helpers import run_worker

def main(argv: list[str]) -> None:
    """``argv``: ``MODULE:FUNCTION rank world port out_path *args`` (the command line without the program)."""
    module, _, function = argv[0].partition(":")
    scenario = getattr(importlib.import_module(module), function)
    args = argv[5:]
    sys.argv = [sys.argv[0], *argv[1:5]]  # rank world port out_path, as run_worker reads them
    run_worker(lambda rank, world: scenario(rank, world, *args))


if __name__ == "__main__":
    main(sys.argv[1:])
