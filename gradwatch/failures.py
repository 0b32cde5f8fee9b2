"""Failures inside gradwatch: logged once, then as rare reminders, never raised into training.

Strict mode (``GRADWATCH_STRICT=1`` in the environment; the test suite sets it) raises the
errors that can only be a bug in gradwatch (:data:`PROGRAMMING_ERRORS`) instead of logging them,
so a programming error cannot hide behind the guards that keep a user's run alive. Failures of
what gradwatch runs on (a collective, a device, a writer: ``RuntimeError``, ``OSError``, ...)
are still logged and survived.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

log = logging.getLogger("gradwatch")

#: Exceptions that mean a bug in gradwatch rather than a failure of the run it watches.
PROGRAMMING_ERRORS = (AttributeError, NameError, TypeError, IndexError, KeyError, AssertionError)


def raise_if_strict(exc: BaseException) -> None:
    """Re-raise ``exc`` under ``GRADWATCH_STRICT=1`` when it is a programming error."""
    if isinstance(exc, PROGRAMMING_ERRORS) and os.environ.get("GRADWATCH_STRICT", "") == "1":
        raise exc


class FailureLog:
    """Reports a failing stage of the monitor (a sink, the checks, the reduction) without flooding the log.

    The first failure of a stage is a WARNING naming it and the error; while it
    keeps failing, a reminder is logged at the 10th, 100th, 1000th, ... failure;
    when the stage works again after failing, one INFO line says so.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def failed(self, stage: str, exc: BaseException, consequence: str = "training continues") -> None:
        """Record that ``stage`` raised ``exc`` (raised again in strict mode when it is a bug)."""
        raise_if_strict(exc)
        count = self.counts.get(stage, 0) + 1
        self.counts[stage] = count
        if count == 1:
            log.warning("gradwatch: %s failed (%s: %s); %s", stage, type(exc).__name__, exc, consequence)
        elif _is_power_of_ten(count):
            log.warning(
                "gradwatch: %s has failed %d times (last: %s: %s); %s", stage, count, type(exc).__name__, exc, consequence
            )

    def guarded(self, stage: str, action: Callable[[], Any], default: Any = None) -> Any:
        """``action()``; if it raises, the failure is recorded and ``default`` returned."""
        try:
            result = action()
        except Exception as exc:
            self.failed(stage, exc)
            return default
        self.succeeded(stage)
        return result

    def succeeded(self, stage: str) -> None:
        """Record that ``stage`` worked; logs its recovery if it had been failing."""
        count = self.counts.pop(stage, 0)
        if count:
            log.info("gradwatch: %s works again after %d failure(s)", stage, count)


def _is_power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1
