"""gradwatch's opaque ops in inductor's generated code: called as the Python functions they are.

Inductor's Python wrapper calls a custom op as ``torch.ops.<ns>.<op>.default(...)``: through the
dispatcher, which boxes the arguments and calls the op's Python kernel back. Measured in context
(torch 2.13, the compiled MLP 8x512 on the CPU, benchmarks/RESULTS.md, twenty-first session), such
a call right after a GEMM costs 70-90 us when the kernel returns at once (9-10 us in a warm loop;
the Python kernel called directly, 16 us in the same context): the dispatcher's path runs cold
after a GEMM swept the caches. 18 calls a step (a forward and a backward op per layer) were ~2
points of that model's step.

So the ops' Python kernels hang on their ``OpOverload`` objects (:data:`DIRECT_KERNEL`, set when
the ops are defined) and inductor's registry of custom codegen for extern kernels
(``torch._inductor.codegen.custom_extern_kernel_codegen``, keyed by the op's name: only graphs that
call gradwatch's ops see it) writes ``torch.ops.gradwatch.<op>.default.gradwatch_kernel(...)``
instead of the dispatcher call. Inductor still schedules the call as the op (what it mutates,
``cudagraph_unsafe``); only the line that calls it changes. The C++ wrapper (AOTInductor,
``cpp_wrapper``) and torch versions without the registry keep the dispatcher call.

The registry is inductor's, and importing inductor costs seconds, so nothing here imports it:
:func:`call_directly` registers once inductor's code generation is loaded (the ops' fake kernels
call it: they run while AOTAutograd traces for inductor, before its code generation). Code that
inductor cached holds the attribute's name: every gradwatch that defines these ops' schemas must set
it (a cached graph is keyed by its FX code, which names the op and its arguments, not this).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterable

log = logging.getLogger("gradwatch")

#: The attribute of each op's ``OpOverload`` that holds its Python kernel (named in cached code).
DIRECT_KERNEL = "gradwatch_kernel"
_CODEGEN_MODULE = "torch._inductor.codegen.custom_extern_kernel_codegen"
_registered = False


def attach_kernel(op: Any, kernel: Callable[..., None]) -> None:
    """Hang ``kernel`` (the op's Python kernel) on its ``OpOverload`` for generated code to call."""
    setattr(op, DIRECT_KERNEL, kernel)


def call_directly(op_names: Iterable[str]) -> None:
    """Make inductor's Python wrapper call the ops named ``op_names`` (``torch.ops.<ns>.<op>.<overload>``)
    through :data:`DIRECT_KERNEL`, once its code generation is loaded (never imports it; until then,
    and on a torch whose registry differs, the wrapper calls them through the dispatcher)."""
    global _registered
    if _registered:
        return
    module = sys.modules.get(_CODEGEN_MODULE)
    if module is None:
        return
    try:
        registry, codegen = module.CUSTOM_EXTERN_KERNEL_CODEGEN, module.CustomCodegen
        for name in op_names:
            registry.setdefault(name, codegen(python=_direct_call))
    except AttributeError as exc:  # a torch whose registry changed: the dispatcher call stays
        log.debug("gradwatch: compiled code calls its ops through the dispatcher (%s)", exc)
    _registered = True


def _direct_call(node: Any, writeline: Callable[[str], None]) -> None:
    """The wrapper's line for one call of the op ``node`` (an ``ir.FallbackKernel``): its kernel, its arguments."""
    args = ", ".join([*node.codegen_args(), *node.codegen_kwargs()])
    writeline(f"{node.python_kernel_name}.{DIRECT_KERNEL}({args})")
