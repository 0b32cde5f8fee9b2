"""gradwatch and ``torch.compile``: the user's names, and compiled code that sees gradwatch's hooks.

Two facts of dynamo (torch 2.13) shape this module:

- ``torch.compile(model)`` wraps the model in an ``OptimizedModule`` whose own module tree
  inserts ``_orig_mod``: layers are named by the model the user wrote, without it.
- By default dynamo does not guard on module hooks (``torch._dynamo.config.
  skip_nnmodule_hook_guards``): code compiled before gradwatch attached keeps running
  without its hooks, and code compiled for *another* instance of the same class (an EMA
  copy, a second model, the other blocks of a regionally compiled model) without hooks is
  reused for the monitored one, hooks left out. While a monitor is attached gradwatch turns
  those guards on, and it drops the frames dynamo already compiled for the model's code, so
  that they are traced again with (or, after close(), without) its hooks: one recompile.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any, Iterable

from torch import nn

from .fsdp1 import strip_wrapper_parts

log = logging.getLogger("gradwatch")

_ORIG_MOD = "_orig_mod"
_guard_users = 0  # monitors attached that need dynamo to guard on module hooks
_saved_skip_hook_guards: bool | None = None


def unwrap(model: nn.Module) -> nn.Module:
    """The module a compiled wrapper (``torch.compile(model)``) stands for; the model itself otherwise."""
    while is_compiled_wrapper(model):
        model = getattr(model, _ORIG_MOD)
    return model


def user_name(qualified: str) -> str:
    """A qualified module name without the ``_orig_mod`` parts that compiled wrappers add, nor the
    ``_fsdp_wrapped_module`` / ``_checkpoint_wrapped_module`` parts of FSDP1 and checkpoint wrappers."""
    qualified = strip_wrapper_parts(qualified)
    if _ORIG_MOD not in qualified:
        return qualified
    return ".".join(part for part in qualified.split(".") if part != _ORIG_MOD)


def is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (``OptimizedModule``)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(dynamo, "OptimizedModule", None)
    return wrapper is not None and isinstance(module, wrapper)


def guard_on_hooks() -> None:
    """Make dynamo guard on module hooks while a monitor is attached (reference-counted)."""
    global _guard_users, _saved_skip_hook_guards
    config = _dynamo_config()
    if config is None:
        return
    if _guard_users == 0:
        _saved_skip_hook_guards = bool(getattr(config, "skip_nnmodule_hook_guards", True))
    _guard_users += 1
    config.skip_nnmodule_hook_guards = False


def release_hook_guards() -> None:
    """Undo one :func:`guard_on_hooks`; the user's setting comes back with the last monitor."""
    global _guard_users
    config = _dynamo_config()
    if config is None or _guard_users == 0:
        return
    _guard_users -= 1
    if _guard_users == 0 and _saved_skip_hook_guards is not None:
        config.skip_nnmodule_hook_guards = _saved_skip_hook_guards


def _dynamo_config() -> Any:
    try:
        import torch._dynamo.config as config
    except Exception:  # a build without dynamo: nothing is compiled, nothing to guard
        return None
    return config


_HOOK_GUARD = "DictGetItemGuardAccessor('_forward_hooks')"


def _guards_on_hooks(entry: Any) -> bool:
    """Whether a dynamo cache entry guards on module forward hooks (compiled while
    ``skip_nnmodule_hook_guards`` was off). Read from the text of its guard tree (private: where
    it cannot be read, the entry counts as not guarding, and is dropped as before)."""
    manager = getattr(entry, "guard_manager", None)
    try:
        return manager is not None and _HOOK_GUARD in str(manager)
    except Exception:
        return False


def model_code(model: nn.Module) -> list[types.CodeType]:
    """The code objects of ``model``'s classes that dynamo may compile: every method of the model's
    own module classes (``forward``, what ``torch.compile`` of a user model and regional
    ``block.compile()`` compile; a Lightning module's ``training_step``, which Lightning compiles
    too) and ``forward`` of the ``torch.nn`` classes in it. The code dynamo wraps a ``torch.nn``
    model in is added where they are used (:func:`_with_wrapper_code`): dynamo may be imported
    only after the monitor attaches."""
    codes: dict[int, types.CodeType] = {}

    def add(function: Any) -> None:
        while function is not None:
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                codes[id(code)] = code
            function = getattr(function, "__wrapped__", None)

    classes: dict[type, None] = {}
    for module in model.modules():
        classes.update(dict.fromkeys(type(module).__mro__))
        if is_compiled_wrapper(module):
            add(getattr(module, "forward", None))
    for cls in classes:
        if cls.__module__.startswith("torch.") or cls is object:
            add(getattr(cls, "forward", None))  # torch.nn's own: forward only
            continue
        for value in vars(cls).values():
            add(getattr(value, "__func__", value))  # functions, static and class methods
    return list(codes.values())


def _with_wrapper_code(codes: Iterable[types.CodeType]) -> list[types.CodeType]:
    """``codes`` and the code dynamo wraps a ``torch.nn`` model in (``torch.compile(nn.Sequential(...))``),
    which all such wrappers share: read from dynamo now, if it is imported."""
    external = sys.modules.get("torch._dynamo.external_utils")
    wrap_inline = getattr(external, "wrap_inline", None)
    consts = getattr(getattr(wrap_inline, "__code__", None), "co_consts", ())
    return [*codes, *(const for const in consts if isinstance(const, types.CodeType))]


def _cache_entries() -> Any:
    """dynamo's reader of a code object's compiled entries, or None (dynamo never imported, or private API gone)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "_debug_get_cache_entry_list", None)


def forget_compiled_frames(codes: Iterable[types.CodeType]) -> int:
    """Drop the frames dynamo compiled for the model's code (``codes``: :func:`model_code`) without
    guards on module hooks, so that the next call traces its hooks as they are now. Returns how many
    code objects were dropped. Frames compiled while a monitor had the hook guards on are kept: they
    retrace by themselves when hooks change, and another model sharing the code (an EMA copy, a
    teacher) keeps them. A free function compiled around the model is not found:
    ``GradMonitor`` warns at the first flush when its hooks did not run.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    entries = _cache_entries()
    reset_code = getattr(eval_frame, "reset_code", None)
    if entries is None or reset_code is None:
        return 0
    dropped = 0
    for code in _with_wrapper_code(codes):
        try:
            # Only code with an entry compiled without hook guards (before a monitor turned them on):
            # an entry that guards on hooks retraces by itself when they change, and resetting a
            # shared code object (torch.nn's, dynamo's wrapper) would recompile every other model.
            if any(not _guards_on_hooks(entry) for entry in entries(code)):
                reset_code(code)
                dropped += 1
        except Exception as exc:  # never break a run over a cache
            log.debug("gradwatch: could not reset dynamo's cache of %s: %s", code.co_name, exc)
    return dropped


def at_recompile_limit(codes: Iterable[types.CodeType]) -> list[tuple[str, int, int]]:
    """(function, compiled variants, limit) of each code object whose compiled variants reached
    dynamo's ``recompile_limit``: dynamo compiles no more variants of it, and a call that matches
    none of them runs eagerly. Read from dynamo's cache (private: nothing where it is missing)."""
    entries = _cache_entries()
    if entries is None:  # dynamo never imported: nothing was compiled (and it is not imported here)
        return []
    limit = getattr(_dynamo_config(), "recompile_limit", None)
    if not isinstance(limit, int):
        return []
    full = []
    for code in _with_wrapper_code(codes):
        try:
            count = len(entries(code))
        except Exception:
            continue
        if count >= limit:
            if code.co_filename.endswith("external_utils.py"):  # what torch.compile(nn.Sequential(...)) compiles
                name = "the compiled torch.nn model's forward (dynamo's wrap_inline)"
            else:
                name = f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{code.co_firstlineno})"
            full.append((name, count, limit))
    return full
