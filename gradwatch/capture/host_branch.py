"""What only sampled steps record, inside compiled code: opaque ops that add into the taps' cells
when their monitor's step is sampled, and do nothing on the others.

Compiled taps record their statistics on sampled steps only, without a graph per kind of step (a
Python flag dynamo guards on doubles every compiled model's graphs: ``taps.py``). Each tap calls
one op of this module (forward: ``mark_output``; backward: ``add_output_grad``) that, when it runs,
reads its monitor's ``RecordingFlags.sampling`` (its copy in :data:`GATE`, a Python bool on the
host: no device read) and on
sampled steps has the layer's tap record the operand eagerly (the code eager taps run: exact at any
layout and magnitude, ``cpu_rows.py`` on the CPU) into its own cells, which are not in the graph;
on the others it returns at once. The op finds the tap by a zero-size view of the layer's backward
row (``grad_tap.row_key_of``: a graph input that inductor does not check at every call, as it checks
every input with elements). In the graph each is one call of a custom op that inductor keeps
(side effects declared, or a write to the device's shared clock: :func:`_mark_output`): inductor
hands it the operand in whatever layout it chose (``flexible_layout``: a channels-last convolution
output too), compiles no code for the statistics, and the graph stays cacheable. Inductor's Python wrapper calls
the op's Python kernel itself, not through the dispatcher (``_compat/inductor.py``: ~16 us a call
in context against 70-90), and only where the monitor's entry in :data:`GATE` (a dict subscript in
the wrapper) says the step is sampled: an unsampled step of compiled code calls no Python function
of gradwatch's.

Measured on the compiled standard workloads (torch 2.13, benchmarks/RESULTS.md, twentieth
session): a branch of ``torch.cond`` per layer and direction, which these ops replaced, cost about
as much a call at run time (~12 us against ~10) but made inductor compile two subgraphs per branch
and bypass its FX graph cache ("Can't cache HigherOrderOperator: cond"): the compiled MLP's first
step took 38 s with a cold cache and 22 s with a warm one (12 and 1.8 s unmonitored), the
Transformer's 101 and 71 s (31 and 3 s). Ops that return their statistics (zeros on unsampled
steps, added to the cells in the graph) cost ~30 us a call: the allocation, the output's checks
and the add.

The ops are ``cudagraph_unsafe``: a CUDA graph replays kernels without running Python, so inductor
leaves them out of its graphs. Compiled code reaches the flags by an int key equal across the
monitor's layers (a per-layer constant would make each block of a regionally compiled model its
own graph). Where the ops cannot be defined, or on a torch before 2.13 (untested there:
:data:`IN_USE`), compiled taps compute these statistics at every step and keep them where the
device's sampling flag says so.
"""

from __future__ import annotations

import collections
import itertools
import logging
import weakref
from typing import TYPE_CHECKING

import torch

from .. import _compat

if TYPE_CHECKING:
    from .recording_flags import RecordingFlags
    from .taps import OutputTap

log = logging.getLogger("gradwatch")

#: key -> the monitor's recording flags, while the monitor lives (which keys are taken)
_FLAGS: "weakref.WeakValueDictionary[int, RecordingFlags]" = weakref.WeakValueDictionary()
#: key -> whether its monitor's step is sampled: what the ops' kernels read, and the gate inductor's
#: generated code reads before it calls them (``_compat/inductor.py``), so that an unsampled step
#: calls no Python function. A plain dict that answers every key (False for unknown ones, for a
#: closed monitor's and a collected one's); kept by ``RecordingFlags.sampling``.
GATE: "collections.defaultdict[int, bool]" = collections.defaultdict(bool)


def register(flags: "RecordingFlags") -> int:
    """The key by which the ops below read ``flags`` (held weakly: a collected monitor's ops record
    nothing): the smallest one free, so that a monitor attached after another one closed
    (:func:`release`) passes compiled code the same int constant, and dynamo's guard on it holds
    (a new key at each attach made each attach -> close cycle a new graph)."""
    key = next(k for k in itertools.count(1) if k not in _FLAGS)
    _FLAGS[key] = flags
    GATE[key] = flags.sampling
    weakref.finalize(flags, _collected, key)
    return key


def _collected(key: int) -> None:
    """A monitor's flags were collected without close(): its gate closes, unless its key went to a
    monitor attached since (after a close(), the key is free while the flags may live on)."""
    if key not in _FLAGS:
        GATE[key] = False


def release(key: int) -> None:
    """The monitor of ``key`` closed: its ops record nothing from now on, and the key is free."""
    _FLAGS.pop(key, None)
    GATE[key] = False


def follow_sampling(key: int, flags: "RecordingFlags") -> None:
    """``flags.sampling`` changed: its gate follows (unless the key went to another monitor since)."""
    if _FLAGS.get(key) is flags:
        GATE[key] = flags.sampling


def _add_output_grad(grad: torch.Tensor, row_key: torch.Tensor, flags_key: int) -> None:
    """On sampled steps, one output gradient of a layer: what the layer's eager tap records of it, by
    the same code (``GradTap.on_output_grad``: its precision of the window, the counts on the host,
    its backward row written at the step's first call), the tap found by ``row_key`` (``_tap_at``).
    The op writes nothing the graph sees (the row is not in the graph): it stays there because it is
    registered as having side effects (:func:`_define_ops`), and the key, only read, is handed over
    as it is also where the graph is functionalized (``aot_eager`` copies what an op declares
    written). Nothing where no tap of a living monitor is keyed so, nor on unsampled steps."""
    if not GATE[flags_key]:
        return
    tap = _tap_at(_FLAGS.get(flags_key), row_key)
    if tap is not None:
        tap.grad_tap.on_output_grad(grad, tap.shared)  # (at run time: its eager path)


def _mark_output(output: torch.Tensor, row_key: torch.Tensor, clock: torch.Tensor, flags_key: int) -> None:
    """On sampled steps, one output of a layer: what the layer's eager tap records of it, by the same
    code (``OutputTap.record_sampled_call``: its forward order on the host, its output statistics at
    its precision of the window), on the host in the order of the compiled calls. The tap is found
    by ``row_key`` (``_tap_at``), which the op only reads. It declares ``clock`` written, the one
    tensor every layer of the device shares: each call then depends on the one before, so that
    inductor keeps them in the forward's order, which this op records (an op with no declared
    write, like the backward's, stays in the graph but may be moved). The layer's facts (whether it
    records output statistics, its precision) are the tap's. Nothing where no tap of a living
    monitor is keyed so, nor on unsampled steps."""
    if not GATE[flags_key]:
        return
    tap = _tap_at(_FLAGS.get(flags_key), row_key)
    if tap is not None:
        tap.record_sampled_call(output)


def storage_place(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t`` starts: its storage's address and its offset there (what keys a tap in
    ``RecordingFlags.taps_at``; a tensor with no elements has no ``data_ptr``: 0)."""
    return t.untyped_storage().data_ptr(), t.storage_offset()


def _tap_at(flags: "RecordingFlags | None", row_key: torch.Tensor) -> "OutputTap | None":
    """The tap of ``flags`` (an op's monitor, None once collected) whose backward row starts where
    ``row_key`` does (``storage_place``: ``RecordingFlags.taps_at``), or None (the monitor closed).
    Compiled code hands the ops tensors, not the tap: a per-layer constant would make each block of
    a regionally compiled model a graph of its own. The precision a tap chose for the window is host
    state that changes at flushes, which a graph must not guard on. Unsampled steps never get here.

    Measured on the compiled MLP 8x512: with float64 reductions on every window, the ops' sampled
    steps copied each 256x512 output and gradient to float64 (~165 and ~80 us a layer), 2.3 ms of
    copies a sampled step (benchmarks/RESULTS.md, thirty-fourth session)."""
    return flags.taps_at.get(storage_place(row_key)) if flags is not None else None


def _returns_nothing(*args: object) -> None:
    """The ops' fake kernel: they return nothing (what they write is declared in their schema). It
    runs while dynamo and AOTAutograd trace, before inductor generates code: the moment to have
    inductor call the kernels directly (``_compat/inductor.py``)."""
    _compat.inductor.call_directly(_OP_NAMES)


_SCHEMAS = {
    "add_output_grad": ("(Tensor grad, Tensor row_key, int flags_key) -> ()", _add_output_grad),
    "mark_output": ("(Tensor output, Tensor row_key, Tensor(a!) clock, int flags_key) -> ()", _mark_output),
}  # fmt: skip


#: The ops' overload: what their calls in generated code mean. Inductor keys the code it caches by
#: the FX graph, which names the op and overload but not how the wrapper calls it, so a change of
#: calling convention takes a new overload name: ``default`` went through the dispatcher, ``direct``
#: called the kernels at every step, ``gated`` calls them behind :data:`GATE` (code cached by this
#: gradwatch names the gate, which an older one lacks: it must not be served to one); ``gated_row``
#: takes each layer's backward cells and dead-unit evidence as one row (``cells.DeviceCells.backward``);
#: ``row_keyed``: ``mark_output`` finds its tap by that row, read only, and writes no forward cells;
#: ``empty_keyed``: both find it by a zero-size view of the row (``grad_tap.row_key_of``), and
#: ``add_output_grad`` writes nothing the graph sees (no copy path, no layer facts as arguments).
OVERLOAD = "empty_keyed"
#: the ops as inductor's wrapper names them
_OP_NAMES = tuple(f"torch.ops.gradwatch.{name}.{OVERLOAD}" for name in _SCHEMAS)


def _op(name: str) -> "torch._ops.OpOverload":
    return getattr(getattr(torch.ops.gradwatch, name), OVERLOAD)


def _define_ops() -> "torch.library.Library | None":
    """The ops in the ``gradwatch`` namespace, one Python kernel each for every backend
    (``CompositeExplicitAutograd``: they run with grad off). Not ``torch.library.custom_op``: its
    Python wrappers cost ~75 us a call against ~25 for ``Library.impl`` (measured with ops that
    returned their statistics). None before torch 2.4 (no ``register_fake``), where torch cannot
    mark an op as having side effects (``torch.fx.node.has_side_effect``, what keeps the backward op,
    which declares no write, in the graph), and where a second copy of gradwatch in the process
    defined them first (their kernels would read that copy's flags)."""
    has_side_effect = getattr(torch.fx.node, "has_side_effect", None) if hasattr(torch, "fx") else None
    if not hasattr(torch.library, "register_fake") or has_side_effect is None:
        return None
    tags = tuple(getattr(torch.Tag, name) for name in ("flexible_layout", "cudagraph_unsafe")
                 if hasattr(torch.Tag, name))  # fmt: skip
    try:
        library = torch.library.Library("gradwatch", "DEF")
        for name, (schema, kernel) in _SCHEMAS.items():
            qualified = f"{name}.{OVERLOAD}"
            library.define(qualified + schema, tags=tags)
            library.impl(qualified, kernel, "CompositeExplicitAutograd")
            torch.library.register_fake(f"gradwatch::{qualified}", _returns_nothing, lib=library)
            _compat.inductor.attach_kernel(_op(name), kernel, GATE, "flags_key")
            # (an op that declares no write would be dead code to FX and inductor: ``add_output_grad``)
            has_side_effect(_op(name))
    except RuntimeError as exc:  # the namespace is taken
        log.debug("gradwatch: compiled taps compute their sampled statistics at every step, masked (%s)", exc)
        return None
    return library


_LIBRARY = _define_ops()  # kept: the registrations live as long as this object
#: whether compiled taps record their sampled statistics through these ops (else at every step,
#: masked). Also whether compiled calls order themselves on the host (``mark_output`` finds its tap
#: and marks its order as an eager tap does), unless the step is traced whole (``detail="full"``
#: records in the graph and counts the device clock down): eager taps read the host order then.
IN_USE = _LIBRARY is not None and _compat.OPS_IN_HOOKS
add_output_grad = _op("add_output_grad") if _LIBRARY is not None else None
mark_output = _op("mark_output") if _LIBRARY is not None else None
