"""Module hooks: each layer's ``OutputTap`` (capture.py) registered as its forward hook.

Design: the tap registers a *tensor* hook on the layer's output instead of using
``register_full_backward_hook``. Full backward hooks wrap the output in
``BackwardHookFunction``; an in-place op after the module (``ReLU(inplace=True)``,
``out += identity``) then fails with "Output 0 of BackwardHookFunctionBackward is a
view and is being modified inplace" (pytorch#61519), and outputs that are dicts are
silently skipped. A tensor hook registered before an in-place op receives the gradient
of the pre-in-place value, works for any output structure, costs one Python call per
module call, and dynamo traces it into compiled code (capture.py says what that takes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import _compat as compiled
from .layers import ForwardAliases, LayerSpec

if TYPE_CHECKING:
    from .taps import OutputTap


class HookSet:
    """The forward hooks gradwatch registered; ``remove()`` takes every one of them off.

    Args:
        model: the monitored model (its code objects, which dynamo may have compiled without the hooks).
        layers: the monitored layers, one tap each.
        taps: the layers' forward hooks, in the same order.
        aliases: the layers whose forward check another layer's tap takes (the layout's).
    """

    def __init__(self, model: nn.Module, layers: list[LayerSpec], taps: list["OutputTap"],
                 aliases: ForwardAliases) -> None:  # fmt: skip
        self._handles: list[RemovableHandle] = []
        for index, targets in aliases.by_checker.items():
            taps[index].alias_taps = tuple(taps[t] for t in targets)
        compiled.guard_on_hooks()
        self._guarding = True
        for layer, tap in zip(layers, taps):
            self._handles.append(layer.module.register_forward_hook(tap))
        #: the code objects dynamo may compile for the model (read at flush: ``ModelWatch.check_recompile_limit``)
        self.model_code = compiled.model_code(model)
        # Code compiled before now does not run the hooks: trace it again.
        self.recompiled = compiled.forget_compiled_frames(self.model_code)

    def remove(self) -> None:
        """Remove every hook (and the compiled code that ran them); idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        codes, self.model_code = self.model_code, []
        if codes:  # once (remove() is idempotent)
            compiled.forget_compiled_frames(codes)
        if self._guarding:
            self._guarding = False
            compiled.release_hook_guards()

