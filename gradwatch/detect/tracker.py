"""Alert bookkeeping: onsets, reminders, recoveries and the bounded list of raised alerts."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable

from ..alerts import Alert, Finding, format_message

log = logging.getLogger("gradwatch")

#: How many of the most recent alerts a monitor keeps (``GradMonitor.alerts``, checkpoints).
KEEP_ALERTS = 1000


def _key(f: Finding) -> tuple[str, str]:
    """The condition a finding belongs to: per layer, but one for non-finite values in the whole
    model (once the weights hold NaN the origin moves upstream; that is the same incident)."""
    return (f.kind, "" if f.kind == "nonfinite" else f.layer)


class AlertTracker:
    """Logs each condition at onset, reminds while it persists, and logs its recovery.

    Hysteresis: a condition stays active until the checks have found it *clearly*
    healthy at ``recovery_flushes`` consecutive flushes (a value in the band next to a
    threshold is neither present nor clear), so a value hovering around a threshold is
    one condition, and a new onset of the same kind needs a clear recovery first. Each
    time the same condition begins again, the clear flushes it needs double (flap damping).
    Log lines are grouped per kind and flush: three or more layers share one line,
    first affected layer first; ``alerts`` keeps one Alert per layer.
    """

    def __init__(
        self, remind_every: int, log_alerts: bool = True, recovery_flushes: int = 2, layers: list[str] | None = None
    ) -> None:
        self.remind_every = remind_every
        self.recovery_flushes = recovery_flushes
        # Distributed runs: every rank tracks the same (reduced) alerts, one rank logs them.
        self._log_alerts = log_alerts
        self._position = {name: i for i, name in enumerate(layers or [])}
        #: the most recent alerts (a bounded ring: every alert stays in the log and the event files)
        self.alerts: deque[Alert] = deque(maxlen=KEEP_ALERTS)
        self.raised = 0  #: every alert raised, counted
        # (kind, layer) -> [flushes since it was last logged, consecutive clear flushes]
        self.active: dict[tuple[str, str], list[int]] = {}
        self.onsets: dict[tuple[str, str], int] = {}  # how often each condition began
        self.callbacks: list[Callable[[Alert], None]] = []

    def update(self, assessment: Any, step: int) -> list[Alert]:
        """Take one flush's assessment (findings and clear keys); return the alerts that are new."""
        findings = assessment.findings if hasattr(assessment, "findings") else list(assessment)
        clear = getattr(assessment, "clear", None)
        new: list[Alert] = []
        current: dict[tuple[str, str], Finding] = {}
        for f in findings:
            current.setdefault(_key(f), f)
        reminders: list[Finding] = []
        onsets: list[Finding] = []
        for key, f in current.items():
            state = self.active.get(key)
            if state is None:
                new.append(self._onset(key, f))
                onsets.append(f)
                continue
            state[0] += 1
            state[1] = 0
            if self.remind_every and state[0] >= self.remind_every:
                state[0] = 0
                reminders.append(f)
        recovered: list[tuple[str, str]] = []
        for key in list(self.active):
            if key in current:
                continue
            state = self.active[key]
            if clear is None or key in clear:
                state[1] += 1
                if clear is None or state[1] >= self.flushes_to_recover(key):
                    del self.active[key]
                    recovered.append(key)
            else:
                state[1] = 0  # undecided (near the threshold, or not judged): still one condition
        self._log(onsets, "")
        self._log(reminders, " (still present)")
        self._log_recoveries(recovered, step)
        self._call_back(new)
        return new

    def _call_back(self, new: list[Alert]) -> None:
        for alert in new if self._log_alerts else ():  # on the writing rank only, as metrics callbacks
            for callback in list(self.callbacks):
                try:
                    callback(alert)
                except Exception as exc:
                    log.warning("gradwatch: alert callback %r failed: %s", callback, exc)

    def raise_onsets(self, findings: list[Finding]) -> list[Alert]:
        """Findings judged between flushes (at a step): new conditions become alerts now, logged
        and passed to the callbacks; conditions already active stay as they are (reminders and
        recoveries are counted at flushes, by :meth:`update`)."""
        onsets, new = [], []
        for f in findings:  # the first finding of a condition that is not active yet
            if _key(f) not in self.active:
                new.append(self._onset(_key(f), f))
                onsets.append(f)
        self._log(onsets, "")
        self._call_back(new)
        return new

    def _onset(self, key: tuple[str, str], f: Finding) -> Alert:
        """A condition begins: its Alert, kept; the condition active from now on."""
        alert = Alert(f.kind, f.layer, int(f.step), float(f.value), float(f.threshold), format_message(f))
        self.alerts.append(alert)
        self.raised += 1
        self.active[key] = [0, 0]
        self.onsets[key] = self.onsets.get(key, 0) + 1
        return alert

    def flushes_to_recover(self, key: tuple[str, str]) -> int:
        """Clear flushes a condition needs to recover: recovery_flushes, doubled each time the
        same condition has begun again (flap damping, at most 64x)."""
        return self.recovery_flushes * 2 ** min(max(self.onsets.get(key, 1) - 1, 0), 6)

    def _order(self, f: Finding) -> tuple[int, int]:
        return (int(f.step), self._position.get(f.layer, -1))

    def _log(self, findings: list[Finding], suffix: str) -> None:
        by_kind: dict[str, list[Finding]] = {}
        for f in sorted(findings, key=self._order):  # groups in the order their first step happened
            by_kind.setdefault(f.kind, []).append(f)
        for kind, group in by_kind.items():
            level = self._level(kind)
            if len(group) < 3:
                for f in group:
                    log.log(level, "%s%s", format_message(f), suffix)
                continue
            names = [f.layer or "(whole model)" for f in group]
            shown = _first_few(names)
            steps = sorted({f.step for f in group})
            at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            values = [f.value for f in group]
            log.log(
                level,
                "[gradwatch] %s at %s in %d layers: %s (first affected: layer %s; values %.3g to %.3g, threshold %.4g)%s",
                kind, at, len(group), shown, names[0], min(values), max(values), group[0].threshold, suffix,
            )  # fmt: skip

    def _log_recoveries(self, keys: list[tuple[str, str]], step: int) -> None:
        by_kind: dict[str, list[str]] = {}
        for kind, layer in keys:
            by_kind.setdefault(kind, []).append(layer)
        level = logging.INFO if self._log_alerts else logging.DEBUG
        for kind, layers in by_kind.items():
            layers.sort(key=lambda name: self._position.get(name, -1))
            where = [f"layer {name}" if name else "the whole model" for name in layers]
            log.log(level, "[gradwatch] %s in %s recovered by step %d", kind, _first_few(where), step)

    def _level(self, kind: str) -> int:
        """ERROR for non-finite values, WARNING otherwise; DEBUG on non-writing ranks."""
        if not self._log_alerts:
            return logging.DEBUG
        return logging.ERROR if kind == "nonfinite" else logging.WARNING

    def state_dict(self) -> dict[str, Any]:
        return {
            "alerts": [a.to_dict() for a in self.alerts],  # at most KEEP_ALERTS: a checkpoint of bounded size
            "raised": self.raised,
            "active": [[k, layer, since, clear] for (k, layer), (since, clear) in self.active.items()],
            "onsets": [[k, layer, n] for (k, layer), n in self.onsets.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alerts = deque((Alert(**a) for a in state.get("alerts", [])), maxlen=KEEP_ALERTS)
        self.raised = int(state.get("raised", len(self.alerts)))
        self.active = {(entry[0], entry[1]): [int(entry[2]), int(entry[3]) if len(entry) > 3 else 0]
                       for entry in state.get("active", [])}  # fmt: skip
        self.onsets = {(k, layer): int(n) for k, layer, n in state.get("onsets", [])}


def _first_few(names: list[str], most: int = 8) -> str:
    """'a, b, c' or, beyond ``most`` names, the first ones and how many more."""
    return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most else "")
