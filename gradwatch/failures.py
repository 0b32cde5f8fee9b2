"""Failures inside gradwatch: logged once, then as rare reminders, never raised into training."""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("gradwatch")


class FailureLog:
    """Reports a failing stage of the monitor (a sink, the checks, the reduction) without flooding the log.

    The first failure of a stage is a WARNING naming it and the error; while it
    keeps failing, a reminder is logged at the 10th, 100th, 1000th, ... failure;
    when the stage works again after failing, one INFO line says so.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def failed(self, stage: str, exc: BaseException, consequence: str = "training continues") -> None:
        """Record that ``stage`` raised ``exc``."""
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
