"""What is compared: no monitoring, gradwatch, and the usual alternatives written out here."""

from __future__ import annotations

import shutil
import tempfile
import time
import types
from typing import Any, Callable

import torch
from torch import nn

from gradwatch import GradMonitor, HealthConfig


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
    ``_foreach_norm`` of the parameter gradients. A lower bound for the default's per-layer cost."""

    name = "default's read floor (no bookkeeping)"

    def __init__(self, model, workload, device):
        super().__init__(model, workload, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.results: list[torch.Tensor] = []
        self.handles = [m.register_forward_hook(self._forward_hook) for m in _layers(model)]

    def _forward_hook(self, module, args, output):
        out = _first_tensor(output)
        if out is None or not out.is_floating_point():
            return
        torch._C._set_grad_enabled(False)
        self.results.append(out.sum())
        torch._C._set_grad_enabled(True)

    def after_backward(self):
        self.results.extend(torch._foreach_norm([p.grad for p in self.params if p.grad is not None], 2))
        self.results.clear()


class OutputReadFloor(DefaultStepFloor):
    """Only the forward hooks' output sums of :class:`DefaultStepFloor`."""

    name = "output sum per layer (no bookkeeping)"

    def after_backward(self):
        self.results.clear()


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
