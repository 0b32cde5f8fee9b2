"""Which modules gradwatch monitors, and what their units are."""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from .. import _compat as compiled

ROOT_NAME = "<root>"

# Modules whose output features live in dim 1 (N, C, ...): convolutions and
# per-channel normalisations. Every other module's units are its last dim.
_CHANNEL_FIRST = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
)


@dataclass
class LayerSpec:
    """One monitored layer: a module, its qualified name, the parameters it owns and its units.

    ``units`` is declared when the monitor attaches, from the module's metadata
    (``out_features``, ``out_channels``, ``num_features``, ``embedding_dim``, ...),
    never from a forward call, so that every rank lays out the same per-unit
    state; ``0`` when the metadata does not say (no dead-unit judgement then).
    """

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    channel_first: bool
    units: int = 0
    #: each parameter's whole shape (FSDP1 holds a flat piece of it on each rank; a DTensor's shape is whole)
    shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    #: per parameter, how many distinct pieces of its gradient the world holds when FSDP1 shards it
    #: (``_compat.fsdp1``), else 0 (whole, or a DTensor that says so itself)
    pieces: list[int] = dataclasses.field(default_factory=list)
    #: per parameter: how to read this rank's piece of its gradient where it is not ``p.grad`` (None:
    #: ``p.grad``): DeepSpeed ZeRO keeps it in its own buffers (``_compat.deepspeed.local_gradient``),
    #: FSDP1 with ``use_orig_params=False`` in its unit's flat gradient (``_compat.fsdp1.flat_gradient``)
    grad_readers: list[Callable[[torch.Tensor], torch.Tensor | None] | None] = dataclasses.field(default_factory=list)

    #: each parameter's name on its module ("weight"; FSDP1's placeholders: the original's name)
    param_names: list[str] = dataclasses.field(default_factory=list)
    #: per parameter: whole on this rank although its gradient is partitioned (DeepSpeed ZeRO 1/2;
    #: ZeRO 3 and FSDP1 hold pieces of the parameter too)
    whole_on_rank: list[bool] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.param_names:
            named = {id(p): n for n, p in self.module.named_parameters(recurse=False)}
            self.param_names = [named.get(id(p), "?") for p in self.params]
        if not self.shapes:
            self.shapes = [tuple(int(s) for s in p.shape) for p in self.params]
        if not self.pieces:
            self.pieces = [0] * len(self.params)
        if not self.grad_readers:
            self.grad_readers = [None] * len(self.params)
        if not self.whole_on_rank:
            self.whole_on_rank = [False] * len(self.params)

    def rank_gradients(self) -> list[torch.Tensor]:
        """This rank's gradients of the layer's parameters that have one: ``p.grad``, or its piece
        where it is kept elsewhere (``grad_readers``: ZeRO's buffers, FSDP1's flat gradient)."""
        grads = (rank_gradient(p, reader) for p, reader in zip(self.params, self.grad_readers))
        return [g for g in grads if g is not None]

    def unit_dim(self, ndim: int) -> int:
        """Index of the unit dimension in an output with ``ndim`` dims."""
        if ndim == 0:
            return -1
        if self.channel_first and ndim >= 2:
            return 1
        return ndim - 1


def rank_gradient(p: torch.Tensor, reader: Callable[[torch.Tensor], torch.Tensor | None] | None) -> torch.Tensor | None:
    """A parameter's gradient as this rank holds it: ``p.grad``, or what ``reader`` (its
    ``LayerSpec.grad_readers`` entry) reads where the gradient is kept elsewhere."""
    return p.grad if reader is None else reader(p)


def _as_patterns(value: str | Sequence[str] | None, arg: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    patterns = list(value)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{arg} must be a glob pattern or a list of glob patterns, got {value!r}")
    return patterns


def discover_layers(
    model: nn.Module,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
) -> list[LayerSpec]:
    """Return the layers of ``model`` to monitor, in module order.

    ``model`` may be compiled (``torch.compile(model)``): names are those of the model the
    user wrote. A layer is a module with trainable parameters of its own; a parameter shared
    by several modules belongs to the first one. ``include``/``exclude`` are
    ``fnmatch`` patterns on qualified module names; a pattern that selects no
    layer raises ``ValueError``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"gradwatch monitors a torch.nn.Module, got {type(model).__name__}; "
            "pass the model itself (for Lightning, use the GradWatch callback)"
        )
    model = compiled.unwrap(model)  # torch.compile(model): the user's model and names
    sharded = compiled.fsdp1.sharded_parameters(model)  # FSDP1's flat pieces: their whole shapes
    flat = compiled.fsdp1.flat_units(model)  # FSDP1 use_orig_params=False: a placeholder per parameter
    sharded.update(flat.sharded)
    include_p = _as_patterns(include, "include")
    exclude_p = _as_patterns(exclude, "exclude")

    seen: set[int] = set()
    candidates: list[LayerSpec] = []
    for name, module in model.named_modules():
        name = compiled.user_name(name)  # a block compiled in place: no "_orig_mod" in its names
        own, names = _own_parameters(module, seen, flat)
        if own:
            shapes = [_whole_shape(p, sharded) for p in own]
            pieces = [sharded[id(p)].pieces if id(p) in sharded else 0 for p in own]
            units = declared_units(module, own, shapes, names)
            candidates.append(LayerSpec(name or ROOT_NAME, module, own, isinstance(module, _CHANNEL_FIRST), units,
                                        shapes, pieces, param_names=names))  # fmt: skip
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} has no parameters that require grad, so there is no "
            "gradient to monitor; attach gradwatch to the model you train"
        )
    _mark_grad_readers(candidates)

    names = [c.name for c in candidates]
    if include_p is not None:
        _check_patterns(include_p, names, "include")
        candidates = [c for c in candidates if _matches(c.name, include_p)]
    if exclude_p is not None:
        _check_patterns(exclude_p, [c.name for c in candidates], "exclude")
        candidates = [c for c in candidates if not _matches(c.name, exclude_p)]
    if not candidates:
        raise ValueError(
            f"include={include_p!r} / exclude={exclude_p!r} leave no layer to monitor; "
            f"the layers are: {', '.join(names)}"
        )
    return candidates


def _own_parameters(module: nn.Module, seen: set[int],
                    flat: compiled.fsdp1.FlatUnits) -> tuple[list[nn.Parameter], list[str]]:  # fmt: skip
    """The trainable parameters ``module`` owns (a shared one belongs to the first module that has it) and
    their names; under FSDP1's ``use_orig_params=False`` gradwatch's placeholders for them instead."""
    own, names = [], []
    for param_name, p in module.named_parameters(recurse=False):
        if p.requires_grad and id(p) not in seen and id(p) not in flat.flat_ids:
            seen.add(id(p))
            own.append(p)
            names.append(param_name)
    for param_name, placeholder in flat.placeholders.get(id(module), []):
        own.append(placeholder)
        names.append(param_name)
    return own, names


def _whole_shape(p: nn.Parameter, sharded: dict) -> tuple[int, ...]:
    """The parameter's whole shape: FSDP1 and ZeRO 3 leave each rank a piece or an empty placeholder."""
    if id(p) in sharded:
        return sharded[id(p)].shape
    zero3 = compiled.deepspeed.whole_shape(p)
    return zero3 if zero3 is not None else tuple(int(s) for s in p.shape)


def _mark_grad_readers(candidates: list[LayerSpec]) -> None:
    """Gradients kept outside ``p.grad`` (``LayerSpec.grad_readers``): DeepSpeed ZeRO's, partitioned over
    the ranks and read as pieces (ZeRO-3 parameters no optimizer holds yet raise
    ``UnsupportedSharding``), and FSDP1's flat gradient for gradwatch's placeholders."""
    zero = compiled.deepspeed.partitioned_gradients(p for c in candidates for p in c.params)
    for c in candidates:
        c.grad_readers = [compiled.deepspeed.local_gradient if id(p) in zero else
                          compiled.fsdp1.flat_gradient if compiled.fsdp1.is_placeholder(p) else None
                          for p in c.params]  # fmt: skip
        c.pieces = [zero.get(id(p), k) for p, k in zip(c.params, c.pieces)]
        c.whole_on_rank = [id(p) in zero and compiled.deepspeed.zero_stage([p]) == "1 or 2" for p in c.params]


def frozen_layers(model: nn.Module, include: str | Sequence[str] | None,
                  exclude: str | Sequence[str] | None) -> list[tuple[str, nn.Module]]:  # fmt: skip
    """Modules ``include``/``exclude`` select that own parameters none of which requires grad now
    (frozen at attach): watched so that gradwatch can say when one is unfrozen (gradual unfreezing)."""
    include_p, exclude_p = _as_patterns(include, "include"), _as_patterns(exclude, "exclude")
    frozen = []
    for name, module in compiled.unwrap(model).named_modules():
        name = compiled.user_name(name) or ROOT_NAME
        own = list(module.parameters(recurse=False))
        if not own or any(p.requires_grad for p in own):
            continue
        if (include_p is None or _matches(name, include_p)) and not (exclude_p and _matches(name, exclude_p)):
            frozen.append((name, module))
    return frozen


def declared_units(module: nn.Module, own: Sequence[nn.Parameter] = (),
                   shapes: Sequence[tuple[int, ...]] | None = None, names: Sequence[str] | None = None) -> int:
    """The number of output units of ``module`` from its metadata; 0 when unknown.

    Units are the output features: dim 1 of the output for convolutions and
    per-channel normalisations, the last dim otherwise. Modules torch does not
    describe fall back to a well-known attribute, then to the length of a 1-D
    ``bias`` or ``weight`` they own (a norm's scale, a layer-scale factor); a
    forward call whose unit dim disagrees is not judged for dead units. ``shapes``: the whole
    shapes of ``own`` where a rank holds pieces (FSDP1, ZeRO 3); ``names``: their names where the
    module no longer holds them (FSDP1's ``use_orig_params=False``).
    """
    if isinstance(module, (nn.Linear, nn.Bilinear)):
        return int(module.out_features)
    if isinstance(module, nn.modules.conv._ConvNd):
        return int(module.out_channels)
    if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)):
        return int(module.num_features)
    if isinstance(module, nn.GroupNorm):
        return int(module.num_channels)
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return int(module.embedding_dim)
    if isinstance(module, nn.MultiheadAttention):
        return int(module.embed_dim)
    if isinstance(module, nn.RNNBase):
        size = module.proj_size if getattr(module, "proj_size", 0) else module.hidden_size
        return int(size) * (2 if module.bidirectional else 1)
    normalized = getattr(module, "normalized_shape", None)  # LayerNorm, RMSNorm
    if isinstance(normalized, (tuple, list)) and normalized:
        return int(normalized[-1])
    for attribute in ("out_features", "out_channels", "num_features", "embedding_dim", "nf"):
        value = getattr(module, attribute, None)  # e.g. transformers' Conv1D has nf
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    named = dict(zip(names, own)) if names is not None else dict(module.named_parameters(recurse=False))
    whole = {id(q): shape for q, shape in zip(own, shapes if shapes is not None else [tuple(q.shape) for q in own])}
    for attribute in ("bias", "weight"):
        p = named.get(attribute)
        if p is not None and id(p) in whole and len(whole[id(p)]) == 1:
            return int(whole[id(p)][0])
    return 0


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _check_patterns(patterns: list[str], names: list[str], arg: str) -> None:
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        shown = ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")
        raise ValueError(
            f"{arg} pattern(s) {unmatched!r} match no layer; patterns are fnmatch globs on "
            f"qualified module names, and the layers with trainable parameters are: {shown}"
        )


def grad_tensors(output: object, _depth: int = 0) -> list[torch.Tensor]:
    """The floating-point tensors of a module output (tensor, tuple, list, dict, namedtuple, dataclass,
    ``ModelOutput``), in order."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if _depth > 4:
        return []
    if isinstance(output, dict):
        values: Iterable[object] = output.values()
    elif isinstance(output, (tuple, list)):
        values = output
    elif hasattr(output, "to_tuple"):  # Hugging Face ModelOutput
        values = output.to_tuple()
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):  # a dataclass output: its fields
        values = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:  # any other object (a cache, a config): never walked into
        return []
    found: list[torch.Tensor] = []
    for item in values:
        found.extend(grad_tensors(item, _depth + 1))
    return found


def output_aliases(layers: list[LayerSpec]) -> dict[int, tuple[int, ...]]:
    """Layers whose output is also another monitored layer's output, by index.

    ``nn.MultiheadAttention`` applies its ``out_proj`` functionally (``F.linear`` with
    ``out_proj.weight``), so ``out_proj``'s own forward hook never runs; the attention's
    output is exactly ``out_proj``'s output, so it is recorded for both layers (its forward
    check once, for both: ``ForwardAliases``).
    """
    index = {id(layer.module): i for i, layer in enumerate(layers)}
    aliases: dict[int, tuple[int, ...]] = {}
    for i, layer in enumerate(layers):
        if isinstance(layer.module, torch.nn.MultiheadAttention):
            target = index.get(id(layer.module.out_proj))
            if target is not None:
                aliases[i] = (target,)
    return aliases


class ForwardAliases:
    """Layers whose forward check is another layer's: ``out_proj`` of a monitored
    ``MultiheadAttention`` (``output_aliases``). The attention's tap sums the output once; the host
    copies that sum into the alias's column where it reads a step (``flush.readback``) and the
    window (``Recorder.prepare_flush``), so every reader sees both layers, as before, for one sum.

    Args:
        layers: the monitored layers, in the order of the buffer's layer columns.
        device: where the buffer is.
    """

    def __init__(self, layers: list[LayerSpec], device: torch.device) -> None:
        #: {a layer that sums the output: the layers whose forward check it is} (``HookSet`` hands the
        #: taps their ``alias_taps`` from it)
        self.by_checker = output_aliases(layers)
        pairs = sorted((alias, target) for target, aliases in self.by_checker.items() for alias in aliases)
        #: [A] the alias layers' columns and [A] the columns whose sums they take (empty: none)
        self.alias = np.array([a for a, _ in pairs], dtype=np.int64)
        self.target = np.array([t for _, t in pairs], dtype=np.int64)
        self._pairs = pairs
        self._alias_t, self._target_t = (torch.from_numpy(cols).to(device) for cols in (self.alias, self.target))

    def __bool__(self) -> bool:
        return len(self.alias) > 0

    def fill(self, forward: np.ndarray) -> None:
        """[L] one step's host forward sums: each alias column takes its target's, in place (item by
        item: a few scalar stores, where fancy indexing is a cold numpy path at every step)."""
        for alias, target in self._pairs:
            forward[alias] = forward[target]

    def fill_rows(self, forward: torch.Tensor) -> None:
        """[steps, L] forward sums in the buffer (any device): the same, in place; two ops."""
        forward.index_copy_(1, self._alias_t, forward.index_select(1, self._target_t))
