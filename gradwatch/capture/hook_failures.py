"""A failure inside a hook: one warning per layer and kind of error, and training goes on.

Hooks never raise into the model's forward or backward (``taps.OutputTap.failed`` keeps the
failure on the tap, and ``flags.failed`` says some tap has one); they are reported here at
``step()``, outside the hook, as the engineering standard asks: a failure inside gradwatch
degrades to one logged warning (raised in strict mode when it is a bug: ``failures.raise_if_strict``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from ..failures import raise_if_strict

log = logging.getLogger("gradwatch")


class HookFailures:
    """The failures reported so far, so that each layer and kind of error is said once."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def report(self, where: str, exc: BaseException) -> None:
        """A hook of ``where`` (a layer's name, or ``"step()"``) raised ``exc``: warn once per layer
        and kind of error (raised in strict mode when it is a bug)."""
        raise_if_strict(exc)
        key = f"{where}:{type(exc).__name__}"
        if key not in self._said:
            self._said.add(key)
            log.warning("gradwatch: internal error in the hook of layer %s (%s: %s); "
                        "its statistics may be incomplete, training continues", where, type(exc).__name__, exc)  # fmt: skip

    def collect(self, flags: Any, taps: Iterable[Any]) -> None:
        """Report what the taps kept since the last step (``flags.failed``: some tap has a failure), and clear it."""
        if not flags.failed:
            return
        flags.failed = False
        for tap in taps:
            if tap.failure is not None:
                self.report(tap.name, tap.failure)
                tap.failure = None
