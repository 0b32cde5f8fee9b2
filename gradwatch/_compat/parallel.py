"""What tensor parallelism and FSDP2 keep only in private places: a parallel style's output layout,
a DTensor's spec, FSDP2's tensor-parallel specs. Each read fails soft: the layer then counts as
not tensor parallel (its statistics stay right for replicated layers; a sharded one is said)."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn


def declared_output(module: Any) -> str | None:
    """How the module's parallel style lays its output out: "units" (sharded on the last dim),
    "rows" (sharded on another dim: tokens, batch), "repeated" (Replicate), None (no style found).

    ``parallelize_module`` registers a forward hook whose closure holds the style's
    ``_prepare_output_fn`` with its ``output_layouts``; ``SequenceParallel``'s output keeps the
    sequence sharding of its input.
    """
    for hook in list(getattr(module, "_forward_hooks", {}).values()):
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                fn = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if not isinstance(fn, functools.partial):
                continue
            name = getattr(fn.func, "__qualname__", "")
            if name.endswith("SequenceParallel._prepare_output_fn"):
                return "rows"
            if name.endswith("Parallel._prepare_output_fn") and fn.args:
                layouts = fn.args[0]
                placement = layouts[0] if isinstance(layouts, (tuple, list)) and layouts else layouts
                if getattr(placement, "is_replicate", lambda: False)():
                    return "repeated"
                dim = getattr(placement, "dim", None)
                if isinstance(dim, int):
                    return "units" if dim == -1 else "rows"
    return None


def local_shape_and_offset(shape: tuple[int, ...], mesh: Any, placements: Any) -> tuple[Any, Any]:
    """This rank's shape and global offset of a tensor laid out by ``placements`` on ``mesh``
    (``torch.distributed.tensor._utils``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)


def dtensor_spec(tensor: Any) -> Any:
    """A DTensor's spec (mesh and placements: ``DTensor._spec``), or None."""
    return getattr(tensor, "_spec", None)


def fsdp_tensor_parallel_specs(model: nn.Module) -> dict[int, Any]:
    """id(parameter) -> the tensor-parallel spec FSDP2 keeps for it (None: FSDP alone shards it).

    FSDP2 shards parameters on its own data-parallel mesh dim; the placements that describe
    tensor parallelism are those of the parameter it was given. Read from FSDP2's parameter
    group (private API): when that changes, FSDP2 parameters count as not tensor parallel.
    """
    specs: dict[int, Any] = {}
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return specs
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                specs[id(fsdp_param.sharded_param)] = getattr(fsdp_param, "_unsharded_dtensor_spec", None)
        except Exception:
            continue
    return specs
