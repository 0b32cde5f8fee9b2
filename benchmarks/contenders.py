"""What is compared: no monitoring, gradwatch, and the usual alternatives written out here."""

from __future__ import annotations

import collections
import math
import shutil
import tempfile
import time
import types
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from gradwatch import GradMonitor, HealthConfig
from gradwatch.capture.column_groups import CPU_LARGE, DOT_MIN
from gradwatch.capture.reductions import _cpu_abs_max, square_sum_into
from gradwatch.registry import outputs


class Contender:
    """One way of training a model copy: ``step()`` runs forward, backward, monitoring, update.

    ``compiled = True`` (see :func:`compiled`): the model runs as ``torch.compile(model)`` (through a
    code object of its own: :func:`compile_alone`),
    compiled after the contender attached whatever it attaches.
    """

    name = "none"
    compiled = False

    def __init__(self, model: nn.Module, workload: Any, device: torch.device) -> None:
        self.model = model
        self.workload = workload
        self.device = device
        self.opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        self.batch = workload.make_batch(device)
        self._run: Any = None

    def after_backward(self) -> None:
        pass

    def prime(self) -> None:
        """Run once after the warm-up, before timing: what a run pays once, not per step."""

    def close(self) -> None:
        """Remove whatever hooks the contender registered (``self.handles``)."""
        for handle in getattr(self, "handles", ()):
            handle.remove()

    def step(self) -> None:
        if self._run is None:
            self._run = compile_alone(self.model) if self.compiled else self.model
        x, y = self.batch
        loss = self.workload.loss(self._run(x), y)
        loss.backward()
        self.after_backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Unmonitored(Contender):
    name = "none"


class UnmonitoredControl(Contender):
    """A second unmonitored copy: the A/A control that shows the noise floor."""

    name = "none (A/A)"


def gradwatch_contender(flush_every: int, with_optimizer: bool = False, detail: str = "standard",
                        heatmap_budget: float | None = None) -> type[Contender]:  # fmt: skip
    """A gradwatch monitor as a contender; ``heatmap_budget``: the sink's image budget if not its default."""

    class GradWatchContender(Contender):
        name = (f"gradwatch flush={flush_every}" + (" full" if detail == "full" else "")
                + (" +update_ratio" if with_optimizer else "")
                + (f" heatmap budget {heatmap_budget:.2%}" if heatmap_budget is not None else ""))  # fmt: skip
        #: what a report selects by (not the name, which a caller may replace: :func:`compiled`)
        gradwatch = True
        image_budget = heatmap_budget  # None: the sink's default

        def __init__(self, model, workload, device):
            super().__init__(model, workload, device)
            self.logdir = tempfile.mkdtemp(prefix="gradwatch-bench-")
            self.monitor = GradMonitor(
                model,
                logdir=self.logdir,
                flush_every=flush_every,
                config=HealthConfig(),
                optimizer=self.opt if with_optimizer else None,
                detail=detail,
            )
            self.buffer_bytes = self.monitor.buffer_bytes
            self._own_time, self._step_start = 0.0, None
            # The heatmap image is drawn when it costs at most its budget of the wall time since the last
            # one; interleaved with other contenders that time would hold their steps too, so its
            # budget's clock here counts this contender's own steps only, as a run alone would.
            outputs = self.monitor._stages.outputs
            board = outputs.tensorboard if outputs is not None else None
            if board is not None:
                board.use_clock(self._own_clock)
                if heatmap_budget is not None:
                    board.heatmap_budget = heatmap_budget

        def prime(self):
            # The first flush imports the sinks (TensorBoard's protobufs, matplotlib) and lays the
            # layout out: once a run, not a flush's cost. The timed rounds then start a fresh window.
            self.monitor.flush()

        def step(self):
            self._step_start = time.perf_counter()
            try:
                super().step()
            finally:
                self._own_time += time.perf_counter() - self._step_start
                self._step_start = None

        def _own_clock(self) -> float:
            """Seconds spent in this contender's steps, the current one included (the drawing's
            cost is measured on this clock too)."""
            running = 0.0 if self._step_start is None else time.perf_counter() - self._step_start
            return self._own_time + running

        def after_backward(self):
            self.monitor.step()  # nothing else: what a user's loop calls (buffer_bytes is read at close)

        def close(self):
            # the largest the device memory got (the read-back's ring may have grown): read once,
            # outside the timed steps (a property summing ~10 tensors' sizes, 10-30 us in context)
            self.buffer_bytes = max(self.buffer_bytes, self.monitor.buffer_bytes)
            self.monitor.close()
            shutil.rmtree(self.logdir, ignore_errors=True)
            window = self.monitor.last_window
            if window is not None and window.sampled is not None:
                # every layer's output gradient seen on the sampled steps (also inside compiled code)
                self.report = {"out_grad_recorded": bool(window.out_seen[window.sampled].all())}

    return GradWatchContender


class LightningGradNorm(Contender):
    """Lightning's ``grad_norm`` utility, converted to floats and logged every step.

    "Logged" the way Lightning's ``TensorBoardLogger.log_metrics`` does it: one
    ``add_scalar`` per value on a ``SummaryWriter`` (here with ``log_every_n_steps=1``).
    """

    name = "lightning grad_norm, logged"

    def __init__(self, model, workload, device):
        super().__init__(model, workload, device)
        from torch.utils.tensorboard import SummaryWriter

        self.grad_norm: Callable = _lightning_grad_norm()
        self.logdir = tempfile.mkdtemp(prefix="gradnorm-bench-")
        self.writer = SummaryWriter(self.logdir)
        self.steps = 0

    def after_backward(self):
        norms = self.grad_norm(self.model, norm_type=2)
        for key, value in norms.items():
            self.writer.add_scalar(key, float(value), self.steps)
        self.steps += 1

    def close(self):
        self.writer.close()
        shutil.rmtree(self.logdir, ignore_errors=True)


class LightningGradNormFloats(Contender):
    """Lightning's ``grad_norm``, converted to floats every step and kept in a list (no logger)."""

    name = "lightning grad_norm, floats"

    def __init__(self, model, workload, device):
        super().__init__(model, workload, device)
        self.grad_norm: Callable = _lightning_grad_norm()
        self.log: list[dict[str, float]] = []

    def after_backward(self):
        norms = self.grad_norm(self.model, norm_type=2)
        self.log.append({k: float(v) for k, v in norms.items()})
        if len(self.log) > 1000:
            self.log.clear()


def _lightning_grad_norm() -> Callable:
    try:
        from lightning.pytorch.utilities import grad_norm
    except ImportError:
        from pytorch_lightning.utilities import grad_norm  # type: ignore[no-redef]
    return grad_norm


class ItemHook(Contender):
    """A tensor hook per parameter calling ``.norm().item()``: the common hand-written monitor."""

    name = "per-param .item() hook"

    def __init__(self, model, workload, device):
        super().__init__(model, workload, device)
        self.values: list[float] = []
        self.handles = [p.register_hook(self._hook) for p in model.parameters() if p.requires_grad]

    def _hook(self, grad: torch.Tensor) -> None:
        self.values.append(grad.norm().item())
        if len(self.values) > 10000:
            self.values.clear()


class FusedFloor(Contender):
    """One ``torch._foreach_norm`` over all gradients per step, kept on the device, copied every 50 steps."""

    name = "fused floor (foreach_norm)"

    def __init__(self, model, workload, device):
        super().__init__(model, workload, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.pending: list[torch.Tensor] = []

    def after_backward(self):
        grads = [p.grad for p in self.params if p.grad is not None]
        self.pending.append(torch.stack(torch._foreach_norm(grads, 2)))
        if len(self.pending) == 50:
            torch.stack(self.pending).cpu()
            self.pending.clear()


class ReadOnceFloor(Contender):
    """Reads each tensor gradwatch reads exactly once, with no bookkeeping: a lower bound.

    Per layer (a module with parameters of its own): one ``sum`` of its output in
    the forward pass and one ``dot`` of its output gradient in the backward pass;
    per step, one ``torch._foreach_norm`` over the parameter gradients. Results stay
    on the device and are dropped. Any monitor computing gradwatch's statistics
    (output non-finite check, output-gradient norm, parameter-gradient norm) with
    separate reductions pays at least this.
    """

    name = "read-once floor (no bookkeeping)"

    def __init__(self, model, workload, device):
        super().__init__(model, workload, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.results: list[torch.Tensor] = []
        self.handles = [
            m.register_forward_hook(self._forward_hook)
            for m in model.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        ]

    def _forward_hook(self, module, args, output):
        out = _first_tensor(output)
        if out is None:
            return
        self.results.append(out.detach().sum())
        if out.requires_grad:
            out.register_hook(self._grad_hook)

    def _grad_hook(self, grad: torch.Tensor) -> None:
        flat = grad.reshape(-1)
        self.results.append(torch.dot(flat, flat))

    def after_backward(self):
        grads = [p.grad for p in self.params if p.grad is not None]
        self.results.extend(torch._foreach_norm(grads, 2))
        self.results.clear()


def compile_alone(model: nn.Module, **compile_options: Any) -> Callable[..., Any]:
    """``torch.compile(model)``, as a run with this one model compiled sees it.

    Dynamo keeps compiled code per Python code object, and every ``torch.compile(module)`` runs
    through the same wrapper code: the models compiled in one process share one list of compiled
    entries, a call checks the guards of the entries in front of its own (a hit moves an entry to
    the front, so in interleaved rounds the model run last is first), and their recompile limit is
    shared. Measured on the MLP (seventeenth session): a monitored model whose taps did nothing but
    the floor's sums took +450 us in forward beside four other compiled contenders, +150 us with
    a code object of its own. Each contender calls the model through a copy of a one-line
    function, so each has its own entry list; the graph is the model's, as with
    ``torch.compile(model)``. ``compile_options``: passed to ``torch.compile`` (``backend=...``).
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    alone = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__, None,
                               forward.__closure__)  # fmt: skip
    return torch.compile(alone, **compile_options)


def flushing_every(kind: type[Contender], flush_every: int) -> type[Contender]:
    """``kind``, a floor that writes at a flush (``ContractReadFloor`` and its kin, whose windows are 50
    steps unless told), with windows of ``flush_every`` steps: the same name, so that a report over
    windows of another length compares gradwatch with a floor that flushes as often."""

    def __init__(self, model, workload, device):
        kind.__init__(self, model, workload, device, flush_every=flush_every)

    return type(kind.__name__, (kind,), {"__init__": __init__})


def compiled(kind: type[Contender], name: str | None = None) -> type[Contender]:
    """The same contender with its model run through ``torch.compile`` (the default inductor backend)."""
    return type(f"Compiled{kind.__name__}", (kind,), {"compiled": True, "name": name or f"{kind.name}, compiled"})


class EmptyHooks(Contender):
    """A forward hook that does nothing on every layer: what having a hook at all costs."""

    name = "empty forward hook per layer"

    def __init__(self, model, workload, device):
        super().__init__(model, workload, device)
        self.handles = [m.register_forward_hook(lambda m, a, o: None) for m in _layers(model)]


class DefaultStepFloor(Contender):
    """What the default reads on a step that is not sampled, with no bookkeeping: one sum of each
    layer's output in a forward hook (the non-finite check; of a tuple, its first tensor) and one
    read of each parameter gradient's size, the cheapest known (:class:`GradientRead`: one
    ``_foreach_norm``, and on the CPU a dot of each large float32 gradient). A lower bound for the
    default's per-layer cost."""

    name = "default's read floor (no bookkeeping)"

    def __init__(self, model, workload, device, cpu_reductions: bool | None = None):
        """``cpu_reductions``: read the gradients the CPU's way (None: where the device is the CPU;
        False on the CPU runs the device path on CPU tensors)."""
        super().__init__(model, workload, device)
        self.cpu_reductions = torch.device(device).type == "cpu" if cpu_reductions is None else cpu_reductions
        self.gradients = GradientRead([p for p in model.parameters() if p.requires_grad], self.cpu_reductions)
        #: the parameters in the read's order (the norm-read ones, then the dot-read ones)
        self.params = self.gradients.params
        self.results: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(self._forward_hook) for m in _layers(model)]

    def _forward_hook(self, module, args, output):
        out = _first_tensor(output)
        if out is not None and out.is_floating_point():
            torch._C._set_grad_enabled(False)
            self._read(module, out)
            torch._C._set_grad_enabled(True)

    def _read(self, module: nn.Module, out: torch.Tensor) -> None:
        """A layer's output, read with grad mode off."""
        self.results.append(out.sum())

    def after_backward(self):
        self.results.extend(self.gradients.read())
        self.results.clear()


class OutputReadFloor(DefaultStepFloor):
    """Only the forward hooks' output sums of :class:`DefaultStepFloor`."""

    name = "output sum per layer (no bookkeeping)"

    def after_backward(self):
        self.results.clear()


class ContractReadFloor(DefaultStepFloor):
    """The reads and the writes the contract's default makes, with no bookkeeping: what no implementation
    of the default can skip. At every step, :class:`DefaultStepFloor`'s reads; on the steps the
    default samples (its plan: ``capture.layout.planned_slots``), each layer's output sum of squares
    and zero count (act_rms, act_zero_fraction), a tensor hook reading its output gradient's norm
    (out_grad_norm) and per-unit norms (the dead-unit evidence), and the parameter gradients' max
    |g| (grad_max); at a window's last step, the values to the host and the scalars gradwatch writes
    (per layer and step grad_norm, nonfinite, log10_grad_rms; global/grad_norm; per layer and
    sampled step the four sampled statistics; dead_fraction once) through the writer gradwatch's
    sink uses (one event per step; ``TensorBoardSink._add_scalars``). Not included: the health
    checks, the per-step judgement and its read-back, the heatmap image (a budget of 0.25% of the
    wall time). One reduction per statistic, the cheapest known on the CPU, in the tensor's dtype (not
    exact ones); the norms of a step stacked into a table made once (one op: kept as 0-d tensors for a
    window instead, the heap's small blocks slowed the optimizer's step after them by 0.2-0.6 ms).
    Device-agnostic (``gpu_check.py`` runs it on CUDA): there max |g| is one foreach inf-norm, as
    gradwatch takes it off the CPU, and the flush copies the window's values to the host at once."""

    name = "contract's read floor (no bookkeeping)"

    def __init__(self, model, workload, device, flush_every: int = 50, cpu_reductions: bool | None = None):
        """``cpu_reductions``: read the gradients and take max |g| the CPU's way (None: where the device
        is the CPU; False on the CPU runs the device path on CPU tensors, as the smoke test does)."""
        super().__init__(model, workload, device, cpu_reductions)
        from gradwatch.capture.layers import discover_layers
        from gradwatch.capture.layout import planned_slots
        from gradwatch.settings import DETAILS
        from gradwatch.sinks.event_writer import summary_writer
        from gradwatch.sinks.tensorboard import TensorBoardSink

        self.flush_every, self.slot, self.steps = flush_every, 0, 0
        self.sampled = planned_slots(flush_every, DETAILS["standard"])
        # the contract's layers, names and units as gradwatch finds them
        self.layers = discover_layers(model)
        self.names = [layer.name for layer in self.layers]
        layer_of = {id(p): i for i, layer in enumerate(self.layers) for p in layer.params}
        self.owner = np.array([layer_of[id(p)] for p in self.params])
        self.sizes = np.array([p.numel() for p in self.params], dtype=np.float64)
        self.index = {id(layer.module): i for i, layer in enumerate(self.layers)}
        layers = [layer.module for layer in self.layers]
        # a MultiheadAttention's output is its out_proj's (applied functionally): read once, written for both
        self.alias = {id(m): (self.index[id(m)], self.index[id(m.out_proj)]) for m in layers
                      if isinstance(m, nn.MultiheadAttention) and id(m.out_proj) in self.index}  # fmt: skip
        self.logdir = tempfile.mkdtemp(prefix="contract-floor-bench-")
        self.sink = TensorBoardSink(summary_writer(self.logdir), owns_writer=True, heatmap=False)
        #: per step: the parameter gradients' norms, then the sums of squares of those read by a dot
        #: (:class:`GradientRead`; each row's parts as views made once: a slice is an op)
        self.table = torch.zeros(self.flush_every, len(self.params), device=device)
        normed = self.gradients.normed
        self.heads = [row[:normed] for row in self.table.unbind(0)]
        self.cells = [list(row[normed:].unbind(0)) for row in self.table.unbind(0)]
        self._projections: dict[int, torch.Tensor] = {}
        self._window()

    def _window(self) -> None:
        self.maxima: list[list[torch.Tensor]] = []  # per sampled step: their max |g|
        self.outputs: list[dict[int, tuple]] = []  # per sampled step: layer -> (sumsq, nonzeros, numel)
        self.out_grads: list[dict[int, tuple]] = []  # per sampled step: layer -> (sum of squares, per-unit norms)

    def _read(self, module: nn.Module, out: torch.Tensor) -> None:
        super()._read(module, out)
        if not self.sampled[self.slot]:
            return
        layers = self._written_for(self.index[id(module)])
        self._sampled_output(out, layers)
        if out.requires_grad and out.ndim:
            dim = self._unit_dim(layers, out)
            out.register_hook(lambda g: self._grad_hook(g, layers, dim))

    def _written_for(self, layer: int) -> tuple[int, ...]:
        """The layers a read of ``layer``'s output is written for (a MultiheadAttention's: its out_proj's too)."""
        return self.alias.get(id(self.layers[layer].module), (layer,))

    def _unit_dim(self, layers: tuple[int, ...], out: torch.Tensor) -> int:
        return self.layers[layers[0]].unit_dim(out.ndim) % out.ndim

    def _sampled_output(self, out: torch.Tensor, layers: tuple[int, ...]) -> None:
        """A sampled step's reads of one output (act_rms, act_zero_fraction), kept for ``layers``."""
        read = (_square_sum(out), outputs._nonzeros(out, torch.float64, True)[0], out.numel())
        for layer in layers:
            self.outputs[-1][layer] = read

    def _grad_hook(self, grad: torch.Tensor, layers: tuple[int, ...], dim: int) -> None:
        read = (_square_sum(grad), self._unit_evidence(grad, dim))
        for layer in layers:
            self.out_grads[-1][layer] = read

    def _unit_evidence(self, grad: torch.Tensor, dim: int) -> torch.Tensor:
        """Per unit, a value that is zero exactly when the unit's gradient is zero for every sample
        (with probability 1): one BLAS product of the samples with random weights (a reduction
        over the samples is strided, several times slower on the CPU), and for channel-first
        outputs a norm over the positions."""
        if dim == grad.ndim - 1:
            rows = grad.reshape(-1, grad.shape[-1])
            return torch.mm(self._weights(rows.shape[0]), rows)
        projected = torch.mm(self._weights(grad.shape[0]), grad.reshape(grad.shape[0], -1))
        return torch.linalg.vector_norm(projected.view(grad.shape[1], -1), dim=1)

    def _weights(self, n: int) -> torch.Tensor:
        weights = self._projections.get(n)
        if weights is None:
            weights = self._projections[n] = torch.randn(1, n, device=self.device)
        return weights

    def _max_abs(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each gradient's max |g| (in the gradients' order) the cheapest way, as gradwatch takes it: on
        the CPU (whose inf-norm kernel is ~8x slower than ``aminmax``) ``aminmax`` of the large ones and
        one foreach max of the small ones' |g| (``capture.reductions``); elsewhere one foreach inf-norm."""
        if not self.cpu_reductions:
            return list(torch._foreach_norm(grads, float("inf")))
        small = [k for k, g in enumerate(grads) if g.numel() < CPU_LARGE]
        maxima = dict(zip(small, _cpu_abs_max([grads[k] for k in small]).unbind())) if small else {}
        for k, g in enumerate(grads):
            if k not in maxima:
                lo, hi = torch.aminmax(g.view(-1))
                maxima[k] = torch.maximum(hi, -lo)
        return [maxima[k] for k in range(len(grads))]

    def step(self):
        if self.sampled[self.slot]:
            self.outputs.append({})
            self.out_grads.append({})
        super().step()

    def after_backward(self):
        self.gradients.read_into(self.heads[self.slot], self.cells[self.slot])
        if self.sampled[self.slot]:
            self.maxima.append(self._max_abs([p.grad for p in self.params]))
        self.results.clear()  # (the forward sums: read by no flush here, as no check reads them)
        self.slot += 1
        if self.slot == self.flush_every:
            self.flush()

    def prime(self):
        self.flush()

    def flush(self) -> None:
        """The window's values to the host and its scalars written; then a new window."""
        sq = self.table[: self.slot].double()
        sq[:, : self.gradients.normed].square_()  # (the norms; the rest are sums of squares already)
        sq = sq.cpu().numpy()
        if len(sq):
            sampled_values = self._sampled_to_host()
            layers = len(self.names)
            per_layer = np.zeros((len(sq), layers))
            np.add.at(per_layer.T, self.owner, sq.T)
            counts = np.bincount(self.owner, self.sizes, layers)
            norm, rms = np.sqrt(per_layer), np.log10(np.sqrt(per_layer / counts) + 1e-45)
            sampled_steps = iter(sampled_values)
            evidence = []
            for t in range(len(sq)):
                total = float(np.sqrt(sq[t].sum()))
                values = [("gradwatch/global/grad_norm", total), ("gradwatch/global/nonfinite", 0.0 if np.isfinite(total) else 1.0)]
                for i, name in enumerate(self.names):
                    values += [(f"gradwatch/grad_norm/{name}", float(norm[t, i])),
                               (f"gradwatch/nonfinite/{name}", 0.0 if np.isfinite(norm[t, i]) else 1.0),
                               (f"gradwatch/log10_grad_rms/{name}", float(rms[t, i]))]  # fmt: skip
                if self.sampled[t]:
                    outputs, out_grads, maxima = next(sampled_steps)
                    per_layer_max = np.zeros(len(self.names))
                    np.maximum.at(per_layer_max, self.owner, maxima)
                    for i, name in enumerate(self.names):
                        if i in outputs:
                            s, nz, n = outputs[i]
                            values += [(f"gradwatch/act_rms/{name}", (float(s) / n) ** 0.5),
                                       (f"gradwatch/act_zero_fraction/{name}", 1 - float(nz) / n)]  # fmt: skip
                        if i in out_grads:
                            values.append((f"gradwatch/out_grad_norm/{name}", float(out_grads[i][0]) ** 0.5))
                            evidence.append((i, out_grads[i][1] == 0))
                    values += [(f"gradwatch/grad_max/{n}", float(m)) for n, m in zip(self.names, per_layer_max)]
                self.sink._add_scalars(values, self.steps + t)
            dead: dict[int, np.ndarray] = {}
            for i, zero in evidence:
                dead[i] = zero if i not in dead else dead[i] & zero
            self.sink._add_scalars([(f"gradwatch/dead_fraction/{self.names[i]}", float(z.mean())) for i, z in dead.items()],
                                   self.steps + len(sq) - 1)  # fmt: skip
            self.steps += len(sq)
        self.slot = 0
        self._window()

    def _sampled_to_host(self) -> list[tuple[dict, dict, list]]:
        """The sampled steps' (outputs, output gradients, maxima), structured as kept, with every tensor
        as a float64 numpy array of its shape, brought to the host in one copy (one sync on a device)."""
        from torch.utils._pytree import tree_flatten, tree_unflatten

        leaves, spec = tree_flatten(list(zip(self.outputs, self.out_grads, self.maxima)))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if not tensors:
            return []
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
        pieces = iter(np.split(flat, np.cumsum([t.numel() for t in tensors])[:-1]))
        on_host = [next(pieces).reshape(leaf.shape) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return tree_unflatten(on_host, spec)

    def close(self):
        super().close()
        self.sink.close()
        shutil.rmtree(self.logdir, ignore_errors=True)


class JudgedReadFloor(ContractReadFloor):
    """:class:`ContractReadFloor` with the least per-step judgement the default must make (#30: nonfinite
    and model-level exploding judged at every step), on the CPU, where the step's values are host
    memory: the step's sum of squares from its row of the table and its forward sums, non-finite
    or above ``HealthConfig().exploding_factor`` times the largest of the last ``RECENT`` calm
    steps' norms is an alarm (counted), else it joins them. In Python floats, with as few distinct
    calls as it can (right after backward each costs 10-60 us the first time: benchmarks/RESULTS.md,
    thirty-eighth session). Not included: the origin of a NaN, the per-layer columns, a warm-up,
    the backward witnesses, anything a flush reads.

    Raises:
        ValueError: ``device`` is not the CPU (elsewhere the values need a lagged read-back).
    """

    name = "contract's read floor, judged every step"
    #: how many calm steps the exploding judgement compares with
    RECENT = 8

    def __init__(self, model, workload, device, flush_every: int = 50, cpu_reductions: bool | None = None):
        if torch.device(device).type != "cpu":
            raise ValueError(f"JudgedReadFloor judges host memory: run it on the CPU, not {device} (ContractReadFloor "
                             "runs anywhere)")  # fmt: skip
        super().__init__(model, workload, device, flush_every, cpu_reductions)
        self.rows = self.table.numpy()  # shares memory with the table
        self.factor_sq = HealthConfig().exploding_factor ** 2
        self.recent: collections.deque[float] = collections.deque(maxlen=self.RECENT)
        self.alarms = 0

    def after_backward(self):
        forward, slot = self._forward_total(), self.slot  # (the step's forward sums; the row about to be written)
        super().after_backward()
        values = self.rows[slot].tolist()
        normed = self.gradients.normed
        total = sum([v * v for v in values[:normed]]) + sum(values[normed:])
        if not math.isfinite(total + forward):
            self.alarms += 1
        elif self.recent and total > self.factor_sq * max(self.recent):
            self.alarms += 1
        else:
            self.recent.append(total)

    def _forward_total(self) -> float:
        """The step's forward sums added on the host: the hooks' outputs (``results``, which the read clears)."""
        return sum([f.item() for f in self.results])


def _square_sum(x: torch.Tensor) -> torch.Tensor:
    """The cheapest sum of squares on the CPU (a BLAS dot of a contiguous float32 tensor: 41 us on 1M
    elements against ~100 for a float32 norm), in the tensor's dtype: a floor's read, not an exact one."""
    if x.dtype == torch.float32 and x.is_contiguous():
        flat = x.view(-1)
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(x).square()


class GradientRead:
    """Every parameter gradient's size read once, the cheapest way known (what gradwatch's unsampled
    step reads on the CPU's own path, ``capture/reductions.py``): on the CPU each float32 gradient of
    at least ``DOT_MIN`` elements by a BLAS dot of its flat view (its sum of squares) and the rest by
    one ``_foreach_norm`` (their norms); elsewhere one ``_foreach_norm`` of them all (one kernel).

    Args:
        params: the parameters, whose gradients are read (:attr:`params`: in the read's order, the
            first :attr:`normed` by the foreach norm, then those read by a dot).
        cpu: take the CPU's reads (False: the device path, on any tensors).
    """

    def __init__(self, params: list[torch.Tensor], cpu: bool) -> None:
        dotted = [cpu and p.dtype == torch.float32 and p.numel() >= DOT_MIN for p in params]
        normed = [p for p, dot in zip(params, dotted) if not dot]
        self.params = normed + [p for p, dot in zip(params, dotted) if dot]
        self.normed = len(normed)

    def read(self) -> list[torch.Tensor]:
        """The norms of the first :attr:`normed` gradients, then the others' sums of squares (0-d
        tensors; a parameter without a gradient is skipped)."""
        grads = [p.grad for p in self.params]
        normed = [g for g in grads[: self.normed] if g is not None]
        values = list(torch._foreach_norm(normed, 2)) if normed else []
        return values + [_square_sum(g) for g in grads[self.normed :] if g is not None]

    def read_into(self, head: torch.Tensor, cells: list[torch.Tensor]) -> None:
        """:meth:`read` written into a row: the norms stacked into ``head`` (one op), each sum of squares
        into its 0-d cell (``out=``)."""
        grads = [p.grad for p in self.params]
        if self.normed:
            torch.stack(torch._foreach_norm(grads[: self.normed], 2), out=head)
        for g, cell in zip(grads[self.normed :], cells):
            square_sum_into(g, cell)


def _first_tensor(output: Any) -> torch.Tensor | None:
    """A layer's output tensor; of a tuple or list (MultiheadAttention: output and weights), its first
    tensor, as gradwatch checks it (``layers.grad_tensors``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    return None


def _layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


def standard() -> list[type[Contender]]:
    return [
        Unmonitored,
        UnmonitoredControl,
        gradwatch_contender(1),
        gradwatch_contender(10),
        gradwatch_contender(50),
        gradwatch_contender(50, detail="full"),
        gradwatch_contender(50, with_optimizer=True),
        LightningGradNorm,
        LightningGradNormFloats,
        ItemHook,
        FusedFloor,
        DefaultStepFloor,
        ReadOnceFloor,
    ]
