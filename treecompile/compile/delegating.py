"""The wrapper's module interface: everything but the call answers as the wrapped model.

`treecompile.compile.wrapper.TreeCompiledModel` holds its model in ``_inner`` (not as a
submodule, so that its parameters are not listed twice) and answers the module interface for
it: parameters, buffers, submodules and their paths, state dicts, modes and devices, so that
optimizers, trainers and adapter libraries see the model's own names. A Hugging Face model's
wrapper also passes ``isinstance`` checks as the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["DelegatingModule"]


class DelegatingModule(nn.Module):
    """A module that answers for the model in ``self._inner`` (set by the subclass with
    ``object.__setattr__``) and holds ``_is_hf``."""

    #: Read by `treecompile.core.reference.reference_model`: per-path runs call ``.model``.
    wraps_a_model_for_trees = True

    @property
    def model(self) -> nn.Module:
        """The wrapped model (its parameters are the ones trained)."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_inner"), name)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._inner.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self._inner.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._inner.buffers(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._inner.named_buffers(*args, **kwargs)

    def children(self):
        return self._inner.children()

    def named_children(self):
        return self._inner.named_children()

    def modules(self):
        return self._inner.modules()

    def named_modules(self, *args, **kwargs):
        return self._inner.named_modules(*args, **kwargs)

    # Module paths are the wrapped model's (``named_modules`` lists them so): PEFT's
    # ``get_peft_model(tree_compile(model), config)`` resolves each target through these and
    # swaps its adapters into the wrapped model; the next call recompiles (Dynamo's guards on
    # the replaced modules), and the rewritten graph is judged again, adapters included.
    def get_submodule(self, target: str) -> nn.Module:
        return self._inner.get_submodule(target)

    def set_submodule(self, target: str, module: nn.Module, *args, **kwargs) -> None:
        self._inner.set_submodule(target, module, *args, **kwargs)

    def get_parameter(self, target: str) -> nn.Parameter:
        return self._inner.get_parameter(target)

    def get_buffer(self, target: str) -> torch.Tensor:
        return self._inner.get_buffer(target)

    def state_dict(self, *args, **kwargs):
        return self._inner.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._inner.load_state_dict(*args, **kwargs)

    def train(self, mode: bool = True) -> DelegatingModule:
        self._inner.train(mode)
        self.training = mode
        return self

    @property
    def __class__(self) -> type:
        # A Hugging Face model's wrapper passes isinstance checks as the model (as a transparent
        # proxy does), so that Trainer.save_model saves the plain model with save_pretrained;
        # type() still gives TreeCompiledModel. See treecompile/integrations/hf.py.
        state = object.__getattribute__(self, "__dict__")
        return type(state["_inner"]) if state.get("_is_hf") else type(self)

    def _apply(self, fn, recurse=True):
        self._inner._apply(fn, recurse)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none)
