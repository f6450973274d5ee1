"""What `tree_compile` accepts as a model: the checks made before anything is captured."""

from __future__ import annotations

from typing import Any

from torch import nn

from treecompile.capture.dynamo import is_hf_model

__all__ = ["EXPECTED", "check_model", "check_sharded", "fsdp1_unit", "refuse_backward_hooks"]

EXPECTED = ("tree_compile expects a causal language model: a Hugging Face *ForCausalLM, or an nn.Module "
            "mapping token ids [1, S] to logits [1, S, vocab]")


def check_model(model: Any) -> None:
    """Raises ``TypeError`` for what is not a causal LM ``tree_compile`` can wrap (FSDP1
    included; FSDP2 units are run unsharded for each call, `treecompile.distributed.unsharded`),
    `UnsupportedModelError` for a module backward hook (`refuse_backward_hooks`)."""
    expected = EXPECTED
    if not isinstance(model, nn.Module):
        raise TypeError(f"{expected}; got {type(model).__name__} {model!r:.60}")
    if type(model).__module__.startswith("torch.nn.") and not any(True for _ in model.children()):
        raise TypeError(f"{expected}; got a bare torch.nn.{type(model).__name__}, which is one layer, not a model")
    if is_hf_model(model):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None and not hasattr(model, "lm_head"):
            raise TypeError(
                f"{expected}; got {type(model).__name__}, a base model without an LM head "
                "(load it with AutoModelForCausalLM)"
            )
    meta = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise TypeError(
            f"{type(model).__name__} is on the meta device ({meta} and others have a shape but no data): "
            "a model built without weights cannot train; load or initialise its weights first "
            "(from_pretrained, or to_empty(device=...) and then load_state_dict)"
        )
    sharded = fsdp1_unit(model)
    if sharded is not None:
        raise TypeError(
            f"{type(model).__name__} is sharded by FSDP ({sharded}), FSDP1: tree_compile captures the whole forward "
            "as one graph, and FSDP1's flat parameters are gathered and freed in hooks outside it; shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard, treecompile.distributed.data_parallel.wrap_fsdp), whose units tree_compile "
            "runs unsharded for each call, or train with DDP (treecompile.distributed.data_parallel.wrap_ddp)"
        )
    refuse_backward_hooks(model)


def refuse_backward_hooks(model: nn.Module) -> None:
    """Raises `UnsupportedModelError` naming a module with a backward hook registered by
    ``register_backward_hook`` (fairseq's ``LinearizedConvolution`` clears a cache in one): torch
    calls such a hook from the autograd node of the module's output, which one captured graph has
    not, and on a tree it would see the packed row's gradients, not each path's."""
    from treecompile.core.errors import UnsupportedModelError

    for name, m in model.named_modules():
        hooks = [h for h in getattr(m, "_backward_hooks", {}).values()]
        if hooks and getattr(m, "_is_full_backward_hook", None) is False:
            what = getattr(hooks[0], "__qualname__", None) or getattr(hooks[0], "__name__", None) or repr(hooks[0])
            raise UnsupportedModelError(
                f"treecompile cannot make this model exact on a tree: module {name or 'the model'!r} "
                f"({type(m).__name__}) has a backward hook registered by register_backward_hook ({what}): torch "
                "calls it from the autograd node of the module's output, which one captured graph does not have, "
                "and on a tree it would see the packed row's gradients, not each path's. Remove the hook for "
                "training (m._backward_hooks.clear()) if it only serves inference.")


def fsdp1_unit(model: nn.Module) -> str | None:
    """The name of ``model``'s first FSDP1 unit (``"the model"`` for the root), or None."""
    return next((name or "the model" for name, m in model.named_modules() if _is_fsdp(m) and not _is_fsdp2(m)),
                None)


def _is_fsdp2(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard``)."""
    return any(c.__name__ == "FSDPModule" and c.__module__.startswith("torch.distributed.fsdp")
               for c in type(module).__mro__)


def check_sharded(model: nn.Module, *, full_check: bool) -> None:
    """Raises ``ValueError`` for the option an FSDP2 model cannot take: ``verify=True`` (the
    full check copies the model to one process)."""
    if not any(_is_fsdp2(m) for m in model.modules()):
        return
    if full_check:
        raise ValueError("tree_compile(verify=True) of an FSDP2 model: the full check copies the model to one "
                         "process; check it before sharding it (tree_compile(model, verify=True) on one process)")


def _is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP unit (FSDP2's ``fully_shard`` or FSDP1's wrapper), without
    importing torch.distributed where it is not loaded."""
    return any(c.__module__.startswith("torch.distributed.fsdp") for c in type(module).__mro__[1:]) or \
        type(module).__module__.startswith("torch.distributed.fsdp")
