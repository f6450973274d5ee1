"""The torch.func state calls and global switches Dynamo captures inside a model's graph.

A pass that removes dead code (`treecompile.passes._graph.eliminate_dead_code`) or builds a value
again on its own (`treecompile.passes._mask_eval.evaluate`) keeps these calls with the ops that
need them.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx

__all__ = ["FUNCTORCH_LEVEL_OPS", "FUNCTORCH_STATE", "STATE_SWITCHES", "functorch_state_nodes", "uses_functorch_levels"]


def _functions(*qualified: str) -> frozenset:
    """The functions named ``module:name`` that this torch has (a name missing is left out)."""
    import importlib

    found = set()
    for q in qualified:
        module, name = q.split(":")
        try:
            f = getattr(importlib.import_module(module), name, None)
        except ImportError:
            f = None
        if f is not None:
            found.add(f)
    return frozenset(found)


#: The state calls of torch.func transforms (``torch.vmap``, ``torch.func.grad``, ``jvp``) as
#: Dynamo captures them: the level pushes and pops, and the autograd switches around them.
#: They have no users and torch marks few of them impure, yet the ops that take a level
#: (below) fail without them: all stay while one such op stays (a level is named by its
#: number, which counts the pushes before it), and all go with the last. (transformers 5.10
#: builds some attention masks with nested vmaps.)
FUNCTORCH_STATE = _functions(
    "torch._functorch.predispatch:_vmap_increment_nesting", "torch._functorch.predispatch:_vmap_decrement_nesting",
    "torch._functorch.predispatch:lazy_load_decompositions",
    "torch._functorch.predispatch:_jvp_increment_nesting", "torch._functorch.predispatch:_jvp_decrement_nesting",
    "torch._functorch.predispatch:_enter_dual_level", "torch._functorch.predispatch:_exit_dual_level",
    "torch._C._functorch:_grad_increment_nesting", "torch._C._functorch:_grad_decrement_nesting",
    "torch._C._functorch:set_inplace_requires_grad_allowed", "torch._C._functorch:push_dynamic_layer_stack",
    "torch._C._functorch:pop_dynamic_layer_stack", "torch._C:_set_fwd_grad_enabled",
    "torch._C._autograd:_saved_tensors_hooks_disable", "torch._C._autograd:_saved_tensors_hooks_enable",
    "torch._functorch.eager_transforms:_set_tensor_requires_grad",
)
#: The ops that take a level the state calls open.
FUNCTORCH_LEVEL_OPS = _functions(
    "torch._functorch.predispatch:_add_batch_dim", "torch._functorch.predispatch:_remove_batch_dim",
    "torch._C._functorch:_wrap_for_grad", "torch._C._functorch:_unwrap_for_grad",
    "torch._functorch.predispatch:_unwrap_for_grad", "torch._functorch.predispatch:_make_dual",
    "torch._functorch.predispatch:_unpack_dual",
)
#: Global switches a model's code may set and reset inside the graph (``torch.inference_mode``,
#: ``sdpa_kernel``): always kept.
STATE_SWITCHES = _functions(
    "torch.autograd.grad_mode:_enter_inference_mode", "torch.autograd.grad_mode:_exit_inference_mode",
    "torch.nn.attention:_sdpa_kernel",
)


def _calls(n: fx.Node, functions: frozenset) -> bool:
    return n.op == "call_function" and n.target in functions


def functorch_state_nodes(nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """The torch.func state calls among ``nodes``, in their order."""
    return [n for n in nodes if _calls(n, FUNCTORCH_STATE)]


def uses_functorch_levels(nodes: Iterable[fx.Node]) -> bool:
    """Whether one of ``nodes`` takes a level a torch.func state call opens."""
    return any(_calls(n, FUNCTORCH_LEVEL_OPS) for n in nodes)
