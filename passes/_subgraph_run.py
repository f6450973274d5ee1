"""Running a piece of a captured graph on example values (the judgements of `_mask_eval`).

`run_subgraph` runs the nodes a value needs, closing any torch.func level and autograd switch a
failure inside a transform leaves open; `evaluate_with_state` runs such a value where it reads
a tensor the model writes in place, on what the call writes, and accepts it only if it does not
change at the next call.
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.passes._graph import PassContext, describe, location_of

__all__ = ["equal_with_nans", "evaluate_with_state", "moved", "run_subgraph"]


def equal_with_nans(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same entries, NaN where the other has NaN (a structural
    table judged at two lengths: ``-inf`` and NaN entries are values like any other)."""
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(a.masked_fill(na, 0), b.masked_fill(nb, 0))


def evaluate_with_state(ctx: PassContext, node: fx.Node, needed: set[fx.Node], placeholders: list[fx.Node],
                         env: dict[fx.Node, object], written: list[int]) -> torch.Tensor:
    """`evaluate` of a value that reads a tensor the model writes in place (`PassContext.state`):
    it reads what the call writes (the state graph run on copies, at the length evaluated),
    and is judged only if it is the same whatever the tensor held before the call and whatever
    the parameters are (else it changes from call to call: refused, naming the tensor)."""
    from treecompile.core.errors import UnsupportedModelError

    state = ctx.state
    where = f"{describe(node)} at {location_of(node)}"
    args = [env[p] for p in placeholders]
    # A parameter the model writes in place (``p.data = p.data.clamp(min=eps)``) is judged as
    # parameters are (the passes' own rules ask that a judgement hold for any of their values).
    buffers = [i for i in written if not (isinstance(args[i], torch.Tensor) and args[i].requires_grad)]
    for i in buffers:
        if i not in state.read_after:
            raise UnsupportedModelError(
                f"treecompile cannot make this model exact on a tree: {where} is judged from "
                f"{state.written_name(i)} as it was before the call, and the model writes it at every call: what is "
                "judged from it now would not hold at the next call.")
    main, _, _ = state.prepare(args)
    results = [run_subgraph(node, needed, placeholders, {**env, **{placeholders[i]: main[i] for i in written}})]
    if buffers:
        moved, _, _ = state.prepare(_moved_state_inputs(args, state.written))
        results.append(run_subgraph(node, needed, placeholders, {
            **env, **{placeholders[i]: moved[i] if i in buffers else main[i] for i in written}}))
    else:
        results.append(results[0])
    same = all(isinstance(r, torch.Tensor) for r in results) and results[0].shape == results[1].shape \
        and equal_with_nans(results[0], results[1])
    if not same:
        names = ", ".join(state.written_name(i) for i in written)
        raise UnsupportedModelError(
            f"treecompile cannot make this model exact on a tree: {where} is judged from {names}, which the model "
            "writes at every call from values that change (what it held before, or a parameter): what is judged "
            "from it now would not hold at the next call.")
    return results[0]


def _moved_state_inputs(args: list, written: tuple[int, ...]) -> list:
    """``args`` with every tensor the model writes holding other values (NaN, or other integers)
    and every parameter moved: what the state graph computes from them shows what it reads."""
    out = list(args)
    g = torch.Generator().manual_seed(0)
    for i, x in enumerate(args):
        if not isinstance(x, torch.Tensor):
            continue
        if i in written:
            if x.is_floating_point() or x.is_complex():
                out[i] = torch.full_like(x, float("nan"))
            elif x.dtype == torch.bool:
                out[i] = ~x
            else:
                out[i] = x * 3 + 7
        elif x.requires_grad and x.is_floating_point():
            out[i] = moved(x, g)
    return out


def moved(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A parameter's values scaled and shifted at random (a judgement that holds for the example's
    parameters only shows as different on them), without its gradient."""
    return x.detach() * 1.7 + 0.3 + torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)


def run_subgraph(node: fx.Node, needed: set[fx.Node], placeholders: list[fx.Node],
                  env: dict[fx.Node, object]) -> torch.Tensor:
    """Runs the nodes of ``needed`` (``node`` last) on ``env``'s placeholder values."""
    sub = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    inputs = []
    for n in node.graph.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            remap[n] = sub.placeholder(n.name)
            inputs.append(env[n])
        else:
            remap[n] = sub.node_copy(n, lambda x: remap[x])
    sub.output(remap[node])
    owner = node.graph.owning_module
    level = torch._C._functorch.maybe_current_level()
    switches = _autograd_switches()
    try:
        with torch.no_grad():
            # `forward`, not the module's call: that one prints the failing line to stderr before
            # raising, and a failure here is an answer (the value cannot be built this way).
            return fx.GraphModule(owner, sub).forward(*inputs)
    finally:
        # A failure inside a torch.func transform must leave neither its levels open nor the
        # switches it sets (saved-tensor hooks off, ...) set.
        while (torch._C._functorch.maybe_current_level() or 0) > (level or 0):
            _pop_functorch_level()
        if _autograd_switches() != switches:
            _set_autograd_switches(*switches)


def _autograd_switches() -> tuple[bool, bool, bool]:
    """(saved-tensor hooks enabled, in-place requires-grad allowed, forward grad enabled)."""
    return (torch._C._autograd._saved_tensors_hooks_is_enabled(),
            torch._C._functorch.get_inplace_requires_grad_allowed(), torch._C._is_fwd_grad_enabled())


def _set_autograd_switches(hooks: bool, inplace: bool, fwd: bool) -> None:
    if hooks:
        torch._C._autograd._saved_tensors_hooks_enable()
    torch._C._functorch.set_inplace_requires_grad_allowed(inplace)
    torch._C._set_fwd_grad_enabled(fwd)


def _pop_functorch_level() -> None:
    """Closes the innermost torch.func level (vmap, grad, jvp or functionalize)."""
    functorch = torch._C._functorch
    kind = functorch.peek_interpreter_stack().key()
    pop = {functorch.TransformType.Vmap: functorch._vmap_decrement_nesting,
           functorch.TransformType.Grad: functorch._grad_decrement_nesting,
           functorch.TransformType.Jvp: functorch._jvp_decrement_nesting,
           functorch.TransformType.Functionalize: functorch._func_decrement_nesting}[kind]
    pop()
