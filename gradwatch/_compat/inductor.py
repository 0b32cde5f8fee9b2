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
call gradwatch's ops see it) writes ``torch.ops.gradwatch.<op>.<overload>.gradwatch_kernel(...)``
instead of the dispatcher call. Inductor still schedules the call as the op (what it mutates,
``cudagraph_unsafe``); only the line that calls it changes. The C++ wrapper (AOTInductor,
``cpp_wrapper``) and torch versions without the registry keep the dispatcher call.

An op that does nothing on most calls may also hang a *gate* on its ``OpOverload``
(:data:`GATE`: a mapping from one of its int arguments to a bool, kept by its owner) and the line
becomes ``if <op>.gradwatch_gate[<that argument>]: <op>.gradwatch_kernel(...)``: where the gate is
False the wrapper calls nothing. Measured on the compiled MLP (twenty-second session, 752 paired
steps): a call of the kernel that returns at once still cost ~20 us in context (its frame and the
two Python frames of its flag lookup, cold after a GEMM); gated, 0.6% of the step less.

The registry is inductor's, and importing inductor costs seconds, so nothing here imports it:
:func:`call_directly` registers once inductor's code generation is loaded (the ops' fake kernels
call it: they run while AOTAutograd traces for inductor, before its code generation). Code that
inductor cached holds the attribute's name: every gradwatch that defines these ops' schemas must set
it (a cached graph is keyed by its FX code, which names the op and its arguments, not this).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterable, Mapping

log = logging.getLogger("gradwatch")

#: The attribute of each op's ``OpOverload`` that holds its Python kernel (named in cached code).
DIRECT_KERNEL = "gradwatch_kernel"
#: ... and the one that holds its gate (named in cached code too): a mapping that answers every key
GATE = "gradwatch_gate"
_CODEGEN_MODULE = "torch._inductor.codegen.custom_extern_kernel_codegen"
#: the op names whose direct calls are registered (each op's fake kernel asks at every trace)
_registered: set[str] = set()
#: ``str(OpOverload)`` ("<ns>.<op>.<overload>") -> the position of its gate's argument (ops with a gate)
_gate_positions: dict[str, int] = {}


def attach_kernel(op: Any, kernel: Callable[..., None], gate: Mapping[int, bool] | None = None,
                  gate_argument: str = "") -> None:
    """Hang ``kernel`` (the op's Python kernel) on its ``OpOverload`` for generated code to call.

    Args:
        op: the op's ``OpOverload``.
        kernel: its Python kernel.
        gate: where given, generated code calls ``kernel`` only where ``gate[<the call's
            gate_argument>]`` is true; it must answer every key (a ``defaultdict(bool)``), since a
            KeyError would stop the compiled code. The kernel must do nothing where it is false.
        gate_argument: the name of the op's int argument that ``gate`` is keyed by.
    """
    setattr(op, DIRECT_KERNEL, kernel)
    if gate is not None:
        setattr(op, GATE, gate)
        _gate_positions[str(op)] = [a.name for a in op._schema.arguments].index(gate_argument)


def call_directly(op_names: Iterable[str]) -> None:
    """Make inductor's Python wrapper call the ops named ``op_names`` (``torch.ops.<ns>.<op>.<overload>``)
    through :data:`DIRECT_KERNEL`, once its code generation is loaded (never imports it; until then,
    and on a torch whose registry differs, the wrapper calls them through the dispatcher). Each name
    is registered once, whoever defines the op (gradwatch's, and the benchmarks' floor's)."""
    names = [name for name in op_names if name not in _registered]
    if not names:
        return
    module = sys.modules.get(_CODEGEN_MODULE)
    if module is None:
        return
    try:
        registry, codegen = module.CUSTOM_EXTERN_KERNEL_CODEGEN, module.CustomCodegen
        for name in names:
            registry.setdefault(name, codegen(python=_direct_call))
    except AttributeError as exc:  # a torch whose registry changed: the dispatcher call stays
        log.debug("gradwatch: compiled code calls its ops through the dispatcher (%s)", exc)
    _registered.update(names)


def _direct_call(node: Any, writeline: Callable[[str], None]) -> None:
    """The wrapper's line for one call of the op ``node`` (an ``ir.FallbackKernel``): its kernel, its
    arguments, behind its gate where it has one."""
    args = node.codegen_args()
    call = f"{node.python_kernel_name}.{DIRECT_KERNEL}({', '.join([*args, *node.codegen_kwargs()])})"
    position = _gate_positions.get(str(getattr(node, "op_overload", "")))
    if position is not None and position < len(args):
        call = f"if {node.python_kernel_name}.{GATE}[{args[position]}]: {call}"
    writeline(call)
