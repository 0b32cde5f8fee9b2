"""Pipeline and tensor-parallel worker (gloo, CPU).

    gloo("tests.distributed.parallel_worker:body", WORLD, MODE[, LOGDIR])  (the gloo fixture: tests/conftest.py)

Modes:

- ``gpipe`` / ``1f1b`` (2 ranks): two pipeline stages of ``Net`` (each rank builds the full
  model and deletes the layers outside its stage, so names are the full model's), 4
  micro-batches, static stage shapes (``input_args`` and ``output_args``).
- ``dead`` (2 ranks): ``1f1b`` with layer ``layers.2`` (on the last stage) killed by a bias of -100
  before its ReLU; rank 0 writes TensorBoard to LOGDIR.
- ``dynamic`` (2 ranks): ``gpipe`` without ``input_args``/``output_args``: the schedule infers
  shapes with an extra forward and backward at its first step.
- ``pp_fsdp`` (4 ranks): a 2x2 ("pp", "dp") mesh, each stage sharded with FSDP2 over "dp",
  each data-parallel replica its own data.
- ``tp`` (2 ranks): ``TPNet`` with fc1 colwise, fc2 rowwise; units 0-3 and 10 of fc1 dead.
- ``sp`` (2 ranks): ``SPNet``, sequence parallel: the norm under ``SequenceParallel`` (its
  gradients are ``Partial``), fc1 colwise from sequence-sharded input, fc2 rowwise back to
  sequence-sharded output; each rank feeds its half of the sequence. An unmonitored twin trains
  in lockstep: gradwatch's reduction of the Partial gradients in ``step()`` (the reduction the
  optimizer would make) must not change training.
- ``tp_dp`` (4 ranks): ``tp`` on the "tp" dim of a 2x2 ("dp", "tp") mesh, sharded with FSDP2 over
  "dp" (torchtitan's 2-D parallelism), each data-parallel replica its own data.

Every rank records, for its own layers and at every step, references computed without
gradwatch: the norm and max of the full parameter gradient (``full_tensor()`` for DTensors),
the squared norm of every output gradient summed over micro-batches (its own tensor hooks),
which units ever had a non-zero output gradient in each window, and the update ratio
from weight copies. Rank 0 also records every metric gradwatch sent to its callback and
every alert; every rank records its ``sync_dist`` and warnings.
"""

from __future__ import annotations

import logging

import torch
from torch import nn


STEPS = 4
FLUSH_EVERY = 2
MICROBATCHES = 4
BATCH = 8
STAGES = {0: ("0", "1"), 1: ("2", "3")}


class Net(nn.Module):
    """Four Linear layers with ReLUs between them; a stage keeps some of them, under their full names."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(
            {"0": nn.Linear(8, 16), "1": nn.Linear(16, 16), "2": nn.Linear(16, 16), "3": nn.Linear(16, 4)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, layer in self.layers.items():
            x = layer(x)
            if name != "3":
                x = torch.relu(x)
        return x


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class SPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


SEQ = 6


def build_sp_net() -> SPNet:
    torch.manual_seed(0)
    net = SPNet()
    with torch.no_grad():
        net.fc1.bias[[0, 1, 2, 3, 10]] = -100.0
    return net


def sp_batch(step: int) -> torch.Tensor:
    return torch.randn(4, SEQ, 8, generator=torch.Generator().manual_seed(step))


def build_net(dead: bool) -> Net:
    torch.manual_seed(0)
    net = Net()
    if dead:
        with torch.no_grad():
            net.layers["2"].bias.fill_(-100.0)
    return net


def build_tp_net() -> TPNet:
    torch.manual_seed(0)
    net = TPNet()
    with torch.no_grad():
        net.fc1.bias[[0, 1, 2, 3, 10]] = -100.0  # dead on both halves of the split units
    return net


def batch(step: int, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 4, generator=generator)


def tp_batch(step: int, replica: int = 0) -> torch.Tensor:
    return torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1000 * replica + step))


class References:
    """Output-gradient references from the test's own hooks, per layer."""

    def __init__(self, named: dict[str, nn.Module]) -> None:
        self.out_sq = {name: 0.0 for name in named}
        self.alive: dict[str, torch.Tensor | None] = {name: None for name in named}
        self.calls = {name: 0 for name in named}
        self.inference = False  # True while the schedule infers shapes (nothing is recorded then)
        for name, module in named.items():
            module.register_forward_hook(self._forward(name))

    def _forward(self, name: str):
        def hook(module, args, output):
            if not torch.is_grad_enabled() or not output.requires_grad:
                return
            self.calls[name] += 1

            def on_grad(grad):
                g = grad.detach().double()
                self.out_sq[name] += float(g.square().sum())
                units = (g.reshape(-1, g.shape[-1]) != 0).any(dim=0)
                self.alive[name] = units if self.alive[name] is None else self.alive[name] | units

            output.register_hook(on_grad)

        return hook

    def take_step(self) -> dict[str, float]:
        out = dict(self.out_sq)
        self.out_sq = {name: 0.0 for name in out}
        return out

    def take_window(self) -> dict[str, list[bool] | None]:
        out = {name: None if a is None else [bool(v) for v in a] for name, a in self.alive.items()}
        self.alive = {name: None for name in out}
        return out


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grad_refs(named: dict[str, nn.Module]) -> tuple[dict[str, float], dict[str, float]]:
    norms, maxima = {}, {}
    for name, module in named.items():
        grads = torch.cat([full(p.grad).detach().reshape(-1).double() for p in module.parameters()])
        norms[name] = float(grads.norm())
        maxima[name] = float(grads.abs().max())
    return norms, maxima


def weights(named: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    return {
        name: torch.cat([full(p).detach().reshape(-1).double() for p in module.parameters()]).clone()
        for name, module in named.items()
    }


def _quiet_under_sequence_parallelism(rank: int, world: int) -> dict:
    """sync_dist=False, and pause(), mean no collective at all under sequence parallelism (whose norm
    gradients are Partial): counted by gradwatch's collective owner and by a wrapped all_reduce."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
    )  # fmt: skip

    from gradwatch import GradMonitor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = build_sp_net()
    parallelize_module(model, mesh, {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
                                     "fc2": RowwiseParallel(output_layouts=Shard(1))})  # fmt: skip
    half = SEQ // world
    original, made = dist.all_reduce, []

    def counting(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    def steps(monitor, n):
        for step in range(n):
            (model(sp_batch(step)[:, half * rank : half * (rank + 1)]).square().sum()).backward()
            before = len(made)
            dist.all_reduce = counting
            try:
                monitor.step()
            finally:
                dist.all_reduce = original
            gradwatch_calls.append(len(made) - before)
            model.zero_grad()

    gradwatch_calls: list[int] = []
    off = GradMonitor(model, flush_every=50, sync_dist=False)
    steps(off, 3)
    off_calls = dict(off._collectives.calls)
    off.close()
    on = GradMonitor(model, flush_every=50)
    steps(on, 2)  # on: one batched collective per step for the Partial gradients
    on.pause()
    paused_from = len(gradwatch_calls)
    steps(on, 2)
    on.resume()
    on_calls = dict(on._collectives.calls)
    on.sync_dist = False  # close without a flush collective, as an exception handler would
    on.close()
    dist.barrier()
    return {"calls_per_step": gradwatch_calls, "paused_from": paused_from, "off_calls": off_calls,
            "on_calls": on_calls}


def body(rank: int, world: int, mode: str, logdir: str | None = None) -> dict:
    import torch.distributed as dist

    from gradwatch import GradMonitor

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("gradwatch").addHandler(Collect(level=logging.WARNING))

    tp_rank = replica = 0
    twin = None
    if mode == "sp_quiet":
        return _quiet_under_sequence_parallelism(rank, world)
    if mode == "sp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
        )  # fmt: skip

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        tp_rank = rank
        plan = {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
                "fc2": RowwiseParallel(output_layouts=Shard(1))}  # fmt: skip
        model, twin = build_sp_net(), build_sp_net()
        parallelize_module(model, mesh, plan)
        parallelize_module(twin, mesh, dict(plan))
        named = {"norm": model.norm, "fc1": model.fc1, "fc2": model.fc2}
        half = SEQ // world

        def run_step(step: int) -> None:
            for m in (model, twin):
                x = sp_batch(step)[:, half * rank : half * (rank + 1)]  # this rank's tokens
                (m(x).square().sum() / (4 * SEQ * 8)).backward()

    elif mode in ("tp", "tp_dp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tp_rank, replica = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
        model = build_tp_net()
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if mode == "tp_dp":
            from torch.distributed.fsdp import fully_shard

            for layer in (model.fc1, model.fc2):
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        named = {"fc1": model.fc1, "fc2": model.fc2}
        run_step = None
    else:
        model, named, run_step = build_stage(rank, world, mode)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05) if twin is not None else None
    twin_gap: list[float] = []  # max |monitored - twin| over the parameters, after each step
    placements: list[dict[str, str]] = []  # the norm's gradient placements after monitor.step()
    grad_identity: list[bool] = []  # every p.grad the same object and placement after monitor.step()
    refs = References(named)
    sent: list[tuple[int, dict]] = []
    monitor = GradMonitor(
        model, flush_every=FLUSH_EVERY, optimizer=opt, detail="full", logdir=logdir if rank == 0 else None,
        metrics_callback=lambda metrics, step: sent.append((step, dict(metrics))),
    )  # fmt: skip
    steps = []
    windows = []
    for step in range(STEPS):
        if run_step is None:
            model(tp_batch(step, replica)).square().mean().backward()
        else:
            run_step(step)
        norms, maxima = grad_refs(named)
        before = weights(named)
        grads_before = {n: (p.grad, str(getattr(p.grad, "placements", ""))) for n, p in model.named_parameters()}
        alerts = monitor.step()
        if twin is not None:  # hands off: every p.grad the same object, with the same placements
            placements.append({n: str(p.grad.placements) for n, p in model.norm.named_parameters()})
            grad_identity.append(all(p.grad is grads_before[n][0] and str(p.grad.placements) == grads_before[n][1]
                                     for n, p in model.named_parameters()))  # fmt: skip
        opt.step()
        if twin_opt is not None:
            twin_opt.step()
            twin_opt.zero_grad()
            twin_gap.append(max(float((full(p) - full(q)).abs().max()) for p, q in zip(model.parameters(), twin.parameters())))
        after = weights(named)
        ratio = {name: float((after[name] - before[name]).norm() / before[name].norm()) for name in named}
        steps.append(
            {"grad_norm": norms, "grad_max": maxima, "out_sq": refs.take_step(), "update_ratio": ratio,
             "alerts": [(a.kind, a.layer) for a in alerts]}
        )  # fmt: skip
        opt.zero_grad()
        if (step + 1) % FLUSH_EVERY == 0:
            windows.append({"alive": refs.take_window()})
    per_step_rows = monitor._recorder.per_step_rows is not None
    monitor.close()
    dist.barrier()
    return {
        "rank": rank,
        "per_step_rows": per_step_rows,
        "tp_rank": tp_rank,
        "replica": replica,
        "layers": list(named),
        "monitor_layers": monitor.layers,
        "sync_dist": monitor.sync_dist,
        "warnings": messages,
        "steps": steps,
        "windows": windows,
        "calls": refs.calls,
        "twin_gap": twin_gap,
        "norm_grad_placements": placements,
        "grad_identity": grad_identity,
        "sent": sent if rank == 0 else [],
        "alerts": [(a.kind, a.layer, a.message) for a in monitor.alerts],
    }


def build_stage(rank: int, world: int, mode: str):
    """The stage module of this rank, its layers by name, and a function that runs one training step."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    group = None
    replica = 0
    if mode == "pp_fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
        stage_index, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        group = mesh["pp"].get_group()
    else:
        stage_index = rank
    model = build_net(dead=mode == "dead")
    for name in list(model.layers):
        if name not in STAGES[stage_index]:
            del model.layers[name]
    if mode == "pp_fsdp":
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    micro = BATCH // MICROBATCHES
    width_in = 8 if stage_index == 0 else 16
    width_out = 16 if stage_index == 0 else 4
    static = mode != "dynamic"
    stage = PipelineStage(
        model, stage_index, 2, torch.device("cpu"), group=group,
        input_args=torch.empty(micro, width_in).requires_grad_(stage_index > 0) if static else None,
        output_args=torch.empty(micro, width_out).requires_grad_() if static else None,
    )  # fmt: skip
    schedule_class = Schedule1F1B if mode in ("1f1b", "dead") else ScheduleGPipe
    schedule = schedule_class(stage, n_microbatches=MICROBATCHES, loss_fn=nn.functional.mse_loss)
    named = {f"layers.{name}": layer for name, layer in model.layers.items()}

    def run_step(step: int) -> None:
        x, y = batch(step, replica)
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)

    return model, named, run_step

