"""FSDP1 worker (gloo, CPU): ``FullyShardedDataParallel`` on 2 or 4 ranks.

    gloo("tests.distributed.fsdp1_worker:body", WORLD, CONFIG, ...)  (the gloo fixture: tests/conftest.py)

Each CONFIG is ``STRATEGY[+nested][+bf16][+offload][+flat]``: the sharding strategy (FULL_SHARD,
SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD: 4 ranks, 2 x 2), every Linear its own unit
(``nested``, an auto-wrap policy) or the whole model one unit, bfloat16 mixed precision, CPU
offload of parameters, ``use_orig_params=False`` (``flat``; else True). Under ``flat`` FSDP cannot
gather gradients itself (``summon_full_params(with_grads=True)`` needs the original parameters):
the twin is the reference, and update_ratio is not measured (the optimizer steps flat parameters). Each rank trains on its own batch; beside it, an unsharded twin of the
model (same initial weights) takes the same step on every rank's batch (the mean of the ranks'
losses, which is what FSDP averages), and the rank records with its own hooks each layer's output
gradient and which units had a non-zero one, to compare with what gradwatch reports.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

LAYERS = ("0", "2", "4")
STEPS = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].bias[:5] = -100.0  # 5 of 16 units of layer 0 dead on every sample
    return model


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def _wrap(model: nn.Module, config: str, world: int):
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    strategy, *options = config.split("+")
    kwargs = {"use_orig_params": "flat" not in options, "device_id": torch.device("cpu"),
              "sharding_strategy": ShardingStrategy[strategy]}  # fmt: skip
    if "nested" in options:
        kwargs["auto_wrap_policy"] = ModuleWrapPolicy({nn.Linear})
    if "bf16" in options:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if "offload" in options:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    if strategy == "HYBRID_SHARD":  # shard over pairs of ranks, replicate across the pairs
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return FullyShardedDataParallel(model, **kwargs)


def _run(rank: int, world: int, config: str) -> dict:
    import torch.distributed as dist

    from gradwatch import GradMonitor

    twin = _model()
    model = _wrap(_model(), config, world)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    said = _Said()
    logging.getLogger("gradwatch").addHandler(said)
    monitor = GradMonitor(model, flush_every=STEPS + 2, optimizer=opt, detail="full")  # close() flushes all
    logging.getLogger("gradwatch").removeHandler(said)
    if "flat" in config.split("+"):  # handing the optimizer over later says the same, not "created without optimizer="
        try:
            monitor.set_optimizer(opt)
            said.messages.append("set_optimizer: accepted")
        except ValueError as exc:
            said.messages.append(f"set_optimizer: {exc}")
    out_sq: dict[str, float] = {}
    alive: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, out):
            def on_grad(g):
                out_sq[name] = out_sq.get(name, 0.0) + float(g.double().square().sum())
                seen = (g != 0).reshape(-1, g.shape[-1]).any(0)
                alive[name] = seen if name not in alive else alive[name] | seen
            out.register_hook(on_grad)
        return hook

    inner = model.module
    for name in LAYERS:
        inner.get_submodule(name).register_forward_hook(keep(name))
    steps = []
    for step in range(STEPS):
        out_sq.clear()
        model(_batch(rank, step)).square().mean().backward()
        loss = sum(twin(_batch(r, step)).square().mean() for r in range(world)) / world
        loss.backward()
        ref = {}
        for name in LAYERS:
            grads = torch.cat([p.grad.reshape(-1).double() for p in twin.get_submodule(name).parameters()])
            ref[name] = {"grad_norm": float(grads.norm()), "grad_max": float(grads.abs().max())}
        before = {n: torch.cat([p.detach().reshape(-1).double().clone() for p in twin.get_submodule(n).parameters()])
                  for n in LAYERS}  # fmt: skip
        monitor.step()
        # FSDP's own unsharded gradient and weights (its collectives, not gradwatch's): the reference
        # under mixed precision, where the float32 twin's forward differs
        flat = "flat" in config
        full_grads, full_before = (None, None) if flat else (_full(model, grads=True), _full(model))
        opt.step()
        twin_opt.step()
        full_after = None if flat else _full(model)
        for name in LAYERS:
            after = torch.cat([p.detach().reshape(-1).double() for p in twin.get_submodule(name).parameters()])
            ref[name]["update_ratio"] = float((after - before[name]).norm() / before[name].norm())
            ref[name]["local_out_sq"] = out_sq[name]
            if not flat:
                ref[name]["fsdp"] = {"grad_norm": float(full_grads[name].norm()), "grad_max": float(full_grads[name].abs().max()),
                                     "update_ratio": float((full_after[name] - full_before[name]).norm() / full_before[name].norm())}  # fmt: skip
        opt.zero_grad()
        twin_opt.zero_grad()
        steps.append(ref)
    calls_before_flush = dict(monitor._collectives.calls)
    monitor.close()
    w = monitor.last_window
    got = [{name: {stat: float("nan") if getattr(w, stat) is None else float(getattr(w, stat)[t, w.layers.index(name)])
                   for stat in ("grad_norm", "grad_max", "nonfinite", "out_grad_norm", "update_ratio")}
            for name in LAYERS} for t in range(STEPS)]  # fmt: skip
    dead = {name: float(w.dead_fraction[w.layers.index(name)]) for name in LAYERS}
    whole = model.state_dict()  # FSDP's full state dict: the user's names, every parameter whole
    in_sync = all(torch.equal(whole[n].detach(), q.detach()) for n, q in twin.named_parameters())
    local_shapes = [tuple(p.shape) for p in model.parameters()]
    alive_units = {n: alive[n].tolist() for n in LAYERS}  # before the histogram step, which the hooks above see too
    histograms = _histograms(model, twin, rank, world) if "flat" in config and "bf16" not in config else None
    dist.barrier()
    return {"config": config, "layers": w.layers, "got": got, "expected": steps, "dead": dead, "histograms": histograms,
            "alive": alive_units, "local_shapes": local_shapes,
            "twin_in_sync": in_sync, "alerts": [a.kind for a in monitor.alerts],
            "calls_before_flush": calls_before_flush, "calls": dict(monitor._collectives.calls),
            "warnings": said.messages}  # fmt: skip


def _histograms(model, twin: nn.Module, rank: int, world: int) -> dict | None:
    """``histograms=True`` under ``use_orig_params=False`` (one step, flush_every=1): rank 0's
    histogram of each layer against the twin's gradient elements that lie in rank 0's shard (where
    FSDP's ``_shard_param_infos`` says they are): {layer: ((count, min, max) written, expected)}."""
    import tempfile

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from gradwatch import GradMonitor

    from ..reference import histograms_against

    logdir = tempfile.mkdtemp() if rank == 0 else None
    monitor = GradMonitor(model, flush_every=1, histograms=True, logdir=logdir)
    model(_batch(rank, 9)).square().mean().backward()
    (sum(twin(_batch(r, 9)).square().mean() for r in range(world)) / world).backward()
    monitor.step()  # the flush: histograms of this rank's slices of the flat gradients
    monitor.close()
    names = {id(m): n.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
             for n, m in model.module.named_modules()}  # fmt: skip
    held: dict[str, list[torch.Tensor]] = {n: [] for n in LAYERS}
    for unit in FSDP.fsdp_modules(model):
        if unit._handle is None:  # a wrapper whose own module holds no parameter (the nested root)
            continue
        flat = unit._handle.flat_param
        for info, where in zip(flat._param_infos, flat._shard_param_infos):
            if where.in_shard:
                grad = twin.get_submodule(names[id(info.module)]).get_parameter(info.param_name).grad.reshape(-1)
                held[names[id(info.module)]].append(grad[where.intra_param_start_idx : where.intra_param_end_idx + 1].clone())
    twin.zero_grad()
    model.zero_grad()
    return None if logdir is None else histograms_against(logdir, held)


class _Said(logging.Handler):
    """The warnings gradwatch logs while it attaches."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _full(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """Each layer's whole weights (or gradients), gathered by FSDP itself."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, with_grads=grads):
        return {name: torch.cat([(p.grad if grads else p).detach().reshape(-1).double().clone()
                                 for p in model.module.get_submodule(name).parameters()]) for name in LAYERS}  # fmt: skip


def body(rank: int, world: int, *configs: str) -> dict:
    return {"runs": [_run(rank, world, config) for config in configs]}



