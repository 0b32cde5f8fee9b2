"""Root causes, not their symptoms: one condition named where it starts (dead layers, cut paths)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..alerts import Finding
from ..flush.window import Window
from .columns import nan_median_columns
from .dead_units import DeadUnitsRule


def root_causes(result: Any, vanishing: list[Finding], dead: list[Finding], order: list[str], w: Window,
                dead_rule: DeadUnitsRule) -> None:  # fmt: skip
    """Report root causes, not their symptoms, then add the kept findings.

    - A layer with dead units has a zero gradient because of them: dead_units, not vanishing.
    - Layers before a completely dead layer get no gradient through it: their vanishing is
      explained by it (named in its alert), not reported separately.
    - The layer after a completely dead one gets an all-zero input: with no bias (a conv
      after a dead BatchNorm) its parameter gradient is exactly zero although gradient
      reaches its output. That is the dead layer's doing, named in its alert, not vanishing.
    - A zero-gradient layer in a vanishing run (its next layer vanishing too, gradient
      starving from the top) is a deep stack underflowing, not dead units (a dead ReLU
      layer sits below a healthy one).
    - A layer whose gradient is zero while its own or the next layer's dead-unit evidence,
      still too little to judge, says every unit is dead so far waits for that judgement:
      the dead layer is named first, and this one with it.
    """
    causes = _Causes(vanishing, order, w, dead_rule)
    dead = [f for f in dead if not causes.in_underflowing_stack(f.layer)]
    causes.wait_for_dead_judgements(vanishing)
    by_position = {causes.position[f.layer]: f for f in dead}
    causes.merge_runs_of_dead_layers(by_position)
    causes.merge_dead_successors(by_position)
    dead = [by_position[i] for i in sorted(by_position)]
    for f in dead:
        causes.explain_neighbours(f)
    result.findings += [f for f in vanishing if f.layer not in causes.explained] + dead
    for name in causes.explained & set(causes.vanished):
        result.clear.discard(("vanishing", name))


class _Causes:
    """One window's findings in the order the layers ran, and which of them another explains.

    Neighbours are taken in the order the layers ran (module order is not data flow: a
    ModuleList of branches lists every branch's first layer before their second ones).
    """

    def __init__(self, vanishing: list[Finding], order: list[str], w: Window, dead_rule: DeadUnitsRule) -> None:
        self.order = order
        self.position = {name: i for i, name in enumerate(order)}
        self.vanished = {f.layer: f for f in vanishing}
        self.index = {name: i for i, name in enumerate(dead_rule.layers)}
        self.dead_rule = dead_rule
        self.explained: set[str] = set()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            # Fed: gradient of a real size reaches the output. A deep stack underflowing leaves
            # subnormal output gradients (1e-44) whose products with the input are exactly zero:
            # that is the vanishing run itself, not a zero input.
            median = nan_median_columns(np.where(w.out_seen, w.out_grad_norm, np.nan))
            self.fed = median > dead_rule.config.vanishing_abs_rms

    def starved(self, name: str | None) -> bool:
        """Vanished to exactly zero although gradient reaches its output: its input is zero."""
        return name in self.vanished and self.vanished[name].value == 0 and bool(self.fed[self.index[name]])

    def in_underflowing_stack(self, layer: str) -> bool:
        """A zero-gradient layer whose next layer vanishes too (not starved): a deep stack underflowing."""
        successor = _successor(self.order, layer)
        return layer in self.vanished and successor in self.vanished and not self.starved(successor)

    def run_ends_underflowing(self, layer: str) -> bool:
        """The run of zero-gradient layers from ``layer`` on (in forward order) ends at a layer whose
        successor still has a (tiny) gradient: a deep stack underflowing, whose zero-gradient layers
        are vanishing now, with nothing to wait for. (A dead layer ends its run before a healthy
        layer, or a starved one.)"""
        i = self.position[layer]
        while i + 1 < len(self.order) and self._zero(self.order[i + 1]) and not self.starved(self.order[i + 1]):
            i += 1
        successor = _successor(self.order, self.order[i])
        return successor in self.vanished and not self._zero(successor) and not self.starved(successor)

    def _zero(self, name: str) -> bool:
        return name in self.vanished and self.vanished[name].value == 0

    def wait_for_dead_judgements(self, vanishing: list[Finding]) -> None:
        """A zero-gradient layer waits for its own or a dead neighbour's dead-unit judgement."""
        confirming, index = self.dead_rule.confirming, self.index
        for f in vanishing:
            if f.value != 0 or self.run_ends_underflowing(f.layer):
                continue
            for name in (f.layer, _successor(self.order, f.layer)):
                if name is not None and (confirming[index[name]] or self.dead_rule.pending_all_dead(index[name])):
                    self.explained.add(f.layer)
            before = _predecessor(self.order, f.layer)  # a layer being confirmed dead that feeds it zeros
            if before is not None and confirming[index[before]] and self.starved(f.layer):
                self.explained.add(f.layer)

    def merge_runs_of_dead_layers(self, by_position: dict[int, Finding]) -> None:
        """A completely dead layer passes no gradient back: a completely dead layer right before it
        has an all-zero output gradient because of it, whatever its own units do. The last of such
        a run is the root (from the last layer back, so a run of any length has one root)."""
        roots: dict[int, Finding] = {}
        behind: dict[str, list[str]] = {}
        for i in sorted(by_position, reverse=True):
            f = by_position[i]
            if f.value < 0.999:
                continue
            root = roots.get(i + 1)
            if root is None:
                roots[i] = f
                continue
            roots[i] = root
            behind.setdefault(root.layer, []).append(f.layer)
            self.explained.add(f.layer)
            by_position.pop(i)
        for layer, names in behind.items():
            root = next(f for f in by_position.values() if f.layer == layer)
            root.detail += (
                f"; it passes no gradient back, so the all-zero output gradient of {_describe(list(reversed(names)))} "
                f"before it follows from it"
            )

    @staticmethod
    def merge_dead_successors(by_position: dict[int, Finding]) -> None:
        """The layer right after a completely dead one sees its constant output: dead units there
        are a consequence, named in its alert, not a separate condition. (Only the next layer:
        module order is not data flow across parallel branches.)"""
        for i in sorted(by_position):
            root, successor = by_position.get(i), by_position.get(i + 1)
            if root is not None and root.value >= 0.999 and successor is not None:
                root.detail += f"; the dead units of layer {successor.layer} after it follow from it"
                by_position.pop(i + 1)

    def explain_neighbours(self, f: Finding) -> None:
        """A dead layer explains the starved layer after it and the vanishing run before it."""
        self.explained.add(f.layer)
        if f.value < 0.999:
            return
        successor = _successor(self.order, f.layer)
        if self.starved(successor):
            self.explained.add(successor)  # type: ignore[arg-type]
            f.detail += f"; its all-zero output leaves layer {successor} without a parameter gradient"
        upstream = []
        for i in range(self.position[f.layer] - 1, -1, -1):  # the contiguous vanishing run before it
            if self.order[i] not in self.vanished:
                break
            upstream.append(self.order[i])
        if upstream:
            self.explained.update(upstream)
            f.detail += (
                f"; it passes no gradient back, which explains the vanishing gradient of "
                f"{_describe(list(reversed(upstream)))} before it"
            )


def forward_order(w: Window) -> list[str]:
    """The window's layers in the order they ran (its last step's forward order), then the rest
    in module order."""
    ran: list[int] = []
    for fwd, _ in reversed(w.step_orders):
        if fwd:
            ran = list(dict.fromkeys(fwd))
            break
    seen = set(ran)
    return [w.layers[i] for i in ran] + [name for i, name in enumerate(w.layers) if i not in seen]


def _successor(layers: list[str], name: str) -> str | None:
    i = layers.index(name)
    return layers[i + 1] if i + 1 < len(layers) else None


def _predecessor(layers: list[str], name: str) -> str | None:
    i = layers.index(name)
    return layers[i - 1] if i > 0 else None


def _describe(names: list[str]) -> str:
    """'layer a' / 'layers a and b' / 'layers a, b, ... (n)' for a message."""
    if len(names) == 1:
        return f"layer {names[0]}"
    if len(names) == 2:
        return f"layers {names[0]} and {names[1]}"
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"{len(names)} layers ({shown})"
