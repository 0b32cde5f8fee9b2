"""What the taps should do at the current step: one ``RecordingFlags`` object shared by every tap of
a monitor (``taps.py``), set by the recorder at each step and read by eager taps as Python values,
by compiled taps through the opaque ops' gate (``host_branch.py``) or, where those are not in use,
through small flags on each device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import host_branch

if TYPE_CHECKING:
    from .taps import OutputTap


class RecordingFlags:
    """What the taps should do at the current step; one object shared by every tap.

    ``sampling``: record every statistic (output gradients, dead-unit evidence, the
    forward order), not only the forward check. Eager taps read the Python bool, compiled taps'
    opaque ops its copy in ``host_branch.GATE``; where those ops are not in use, compiled taps read
    its copy on their device (``device_flags``, written here only when the value changes: one
    small fill per device, four times a window with the default). ``active``: False while paused
    (a Python value compiled code guards on: pausing is one graph variant more). ``step``: the
    number of steps recorded so far.
    """

    def __init__(self) -> None:
        #: ``sampling``'s value: what the hot paths (an eager tap's call, ``Recorder.record_step``) read,
        #: without the property's call; written by the property's setter only
        self._sampling = True
        #: (sampled as bool, sampled as 0/1 in the stat dtype) on each device that holds cells, where
        #: compiled taps take the masked path (``host_branch.IN_USE`` False; else empty)
        self.device_flags: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: how the opaque ops of compiled code find these flags (``host_branch.py``)
        self.key = host_branch.register(self)
        #: every step is sampled (``detail="full"``; fixed at attach): compiled taps need no flag
        self.every_step = False
        #: the configurations with a KV-cache switch (``config.use_cache``, Hugging Face) in the model
        self.cache_configs: list[Any] = []
        #: compiled taps hand outputs through an autograd function instead of putting a tensor hook
        #: on them: True while the model's KV cache is on (see ``follow_cache_config``); a Python
        #: value compiled code guards on, read back at every step
        self.grads_through_function = False
        self.active = True
        #: Counts recorded steps, and every zeroing of the cells (a flush, calls no step() will
        #: claim): a tap that last wrote its cells at an earlier count is at its first call since
        #: they were zeroed, and writes instead of adding (eager only; compiled code never reads it).
        self.step = 0
        #: Eager forward checks that wrote their cell at their layer's first call of this step (a
        #: host count, zeroed at every step): where every layer's did, no cell holds an older step's
        #: sum, and the per-step stage can skip zeroing them (``per_step_rows.py``).
        self.forward_writes = 0
        #: Some tap failed since the last step (its ``failure`` says how); reported at step(), not in the hook.
        self.failed = False
        #: where a tap's backward row starts (``host_branch.storage_place``: storage address, offset) -> the
        #: tap: how the opaque ops' kernels, handed a zero-size view of the row (``grad_tap.row_key_of``),
        #: reach the layer's tap (``host_branch``)
        self.taps_at: dict[tuple[int, int], "OutputTap"] = {}

    def close(self) -> None:
        """The monitor closed: the taps record nothing more (those compiled code still runs too), and
        the ops' key is free for the next monitor (``host_branch.register``)."""
        self.active = False
        host_branch.release(self.key)
        self.taps_at.clear()  # compiled code may keep these flags: not the taps, which reach the model

    @property
    def sampling(self) -> bool:
        return self._sampling

    @sampling.setter
    def sampling(self, value: bool) -> None:
        value = bool(value)
        if value != self._sampling:
            self._sampling = value
            host_branch.follow_sampling(self.key, self)
            for sampled, count in self.device_flags:
                sampled.fill_(value)
                count.fill_(float(value))

    def watch_cache_switch(self, model: torch.nn.Module) -> None:
        """Follow ``config.use_cache`` (a Hugging Face model's KV-cache switch) of every module of
        ``model`` that has one: the model itself, or one inside a user's wrapper (a Lightning module)."""
        configs = {}
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "use_cache"):
                configs[id(config)] = config
        self.cache_configs = list(configs.values())
        self.follow_cache_config()

    def follow_cache_config(self) -> None:
        """Compiled taps take output gradients through an autograd function while a KV cache in the
        model is on. A tensor hook registered in a frame that also builds a ``DynamicCache`` trips
        a dynamo bug (``capture/grad_passthrough.py``): dynamo drops the whole-model graph (8 graphs
        for 1 on a tiny GPT-2) and ``fullgraph=True`` fails. Read at attach and at every step (a
        getattr per configuration); with the cache off, the tensor hook (the path measured
        everywhere else) is kept."""
        if self.cache_configs:
            self.grads_through_function = any(getattr(c, "use_cache", False) for c in self.cache_configs)
