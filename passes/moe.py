"""check_moe_regions_pass: mixture-of-experts blocks and the router's auxiliary loss.

Two regions of a captured MoE model move rows around or reduce over them, and both are
exact on a tree for a reason the verify pass cannot see op by op. The wrapper brackets
each with marker ops (:mod:`treecompile.passes.markers`); this pass finds every region,
checks what can be checked, lets the verify pass trust its nodes, and removes the markers.

**Experts** (``experts_begin`` ... ``experts_end``, one region per MoE layer). HF's
``grouped_mm`` experts sort the ``T * k`` (token, expert) pairs by expert, run one
grouped matmul per projection and scatter the results back. The result is token-wise:
output row ``t`` is ``sum_j w[t, j] * expert[idx[t, j]](x[t])`` from row ``t``'s own hidden
state and routing (HF's experts have no capacity limit, so no token's routing can
displace another's). A token-wise function of rows that equal the per-path rows gives
rows that equal the per-path rows: exact on the tree as it stands. Checked: the region
reads no sequence tensor other than its three inputs.

**Router auxiliary loss** (``router_stats_begin`` ... ``router_aux_end``, one region). The
ground truth is per-path training: all ``P`` paths through the unmodified model in one
padded batch, and HF's ``load_balancing_loss_func(router_logits, num_experts, top_k,
attention_mask)`` over every real token of every path; the model's loss is the main loss
plus ``router_aux_loss_coef * aux``. The statistics it reduces over the tokens (the
fraction of top-k slots each expert receives, the mean router probability per expert)
are sums over tokens divided by the number of tokens. A tree row computes its token once
but per-path training computes it once per path through it, ``path_count`` times, with
identical router logits (everything up to the router is per-path exact). So the wrapper
calls the model's own function with ``attention_mask = path_count``: HF's function weights
each row's statistics by the mask (``sum(mask * stat) / sum(mask)``), which with these
weights is the sum over the per-path tokens, and ``sum(path_count)`` is their number.
Padding rows have ``path_count`` 0. Checked: every node in the region that reduces over
the rows (an input with a row dimension, ``S`` or ``S * k``, and an output without)
depends on the weights, so a function that ignores its mask is refused, not silently
unweighted.

Counters (``ctx.counters["check_moe_regions_pass"]``): ``experts`` (MoE layers),
``router_aux_loss`` (1 when the loss is computed) and ``router_layers`` (layers whose router
logits it reads).
"""

from __future__ import annotations

import inspect
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from treecompile.errors import UnsupportedModelError
from treecompile.passes._graph import PassContext, describe, is_row_size, source_of, value
from treecompile.passes.markers import is_marker

__all__ = ["check_moe_regions_pass", "RouterAux", "router_aux_of"]

#: The parameters HF's ``load_balancing_loss_func`` takes, in order (32 model families).
AUX_LOSS_PARAMS = ("gate_logits", "num_experts", "top_k", "attention_mask")


@dataclass(frozen=True)
class RouterAux:
    """A Hugging Face model's router auxiliary loss, as its ``forward`` adds it.

    Attributes:
        loss_fn: the model module's ``load_balancing_loss_func``.
        num_experts: experts per MoE layer.
        top_k: experts per token.
        coef: ``router_aux_loss_coef``; the model's loss is ``main + coef * aux``.
    """

    loss_fn: Callable
    num_experts: int
    top_k: int
    coef: float

    def tree_aux_loss(self, router_logits: tuple[torch.Tensor, ...], path_count: torch.Tensor) -> torch.Tensor:
        """The auxiliary loss of per-path training, from the tree's router logits.

        Args:
            router_logits: per MoE layer, ``[S, E]`` (or ``[1, S, E]``) router logits of the rows.
            path_count: ``[S]`` paths through each row (0 on padding rows).

        Returns:
            The unscaled auxiliary loss (a scalar), computed by the model's own function with
            each row weighted by its ``path_count`` (see the module docstring).
        """
        if not router_logits:
            raise UnsupportedModelError("the model returned no router logits for its router auxiliary loss")
        flat = [t.reshape(-1, t.shape[-1]) for t in router_logits]
        *logits, weights = torch.ops.treecompile.router_stats_begin(flat, path_count.to(torch.float32))
        aux = self.loss_fn(tuple(logits), self.num_experts, self.top_k, weights[None])
        return torch.ops.treecompile.router_aux_end(aux)

    def tree_stats(self, router_logits: tuple[torch.Tensor, ...], path_count: torch.Tensor) -> torch.Tensor:
        """The sums the auxiliary loss is made of, over the rows given (one streamed part).

        HF's ``load_balancing_loss_func`` is ``E * sum_e (T_e / N) (P_e / N)`` (Switch
        Transformer), where over all layers and tokens ``T_e`` counts the top-k slots given to
        expert ``e``, ``P_e`` adds up its router probability and ``N`` counts the tokens, each
        token weighted by its mask (here ``path_count``). Sums over parts of a tree add up to
        the sums over the tree, so a streamed call adds the parts' stats and applies
        `aux_from_stats` once (`check_stats_form` confirms the model's function has this form).

        Args:
            router_logits: per MoE layer, ``[S, E]`` (or ``[1, S, E]``).
            path_count: ``[S]`` paths through each row (0 on padding rows).

        Returns:
            ``[2E + 1]``: ``T`` (no gradient: top-k is piecewise constant), ``P`` (with
            gradient), ``N``; in float64 for a float64 model, else float32.
        """
        flat = [t.reshape(-1, t.shape[-1]) for t in router_logits]
        dtype = torch.promote_types(flat[0].dtype, torch.float32)
        *logits, w = torch.ops.treecompile.router_stats_begin(flat, path_count.to(dtype))
        counts = w.new_zeros(self.num_experts)
        probs = w.new_zeros(self.num_experts)
        for layer in logits:
            p = torch.softmax(layer, dim=-1)
            top = torch.topk(p, self.top_k, dim=-1).indices
            counts = counts.scatter_add(0, top.reshape(-1), w.repeat_interleave(self.top_k))
            probs = probs + (p.to(dtype) * w[:, None]).sum(0)
        n = w.sum() * len(logits)
        return torch.ops.treecompile.router_aux_end(torch.cat([counts.detach(), probs, n[None]]))

    def aux_from_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """The unscaled auxiliary loss from the ``[2E + 1]`` sums of `tree_stats` (added over
        parts): ``E * sum(T * P) / N^2``. Linear in ``P`` given the counts, so its gradient
        with respect to a part's ``P`` is the same constant for every part."""
        e = self.num_experts
        counts, probs, n = stats[:e], stats[e:2 * e], stats[2 * e]
        return e * (counts * probs).sum() / (n * n)

    def check_stats_form(self) -> None:
        """Refuses a ``load_balancing_loss_func`` that `aux_from_stats` does not reproduce:
        both run on random router logits of two layers and random row weights, in float64."""
        gen = torch.Generator().manual_seed(0)
        logits = tuple(torch.randn(7, self.num_experts, generator=gen, dtype=torch.float64) for _ in range(2))
        weights = torch.randint(0, 4, (7,), generator=gen).to(torch.float64)
        weights[0] = 1.0
        want = torch.as_tensor(self.loss_fn(logits, self.num_experts, self.top_k, weights[None]), dtype=torch.float64)
        got = self.aux_from_stats(self.tree_stats(logits, weights))
        # HF sums the statistics in float32: agreement to float32 rounding.
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            try:
                where = f" ({inspect.getsourcefile(self.loss_fn)}:{inspect.getsourcelines(self.loss_fn)[1]})"
            except (OSError, TypeError):
                where = ""
            name = f"{getattr(self.loss_fn, '__module__', '?')}.load_balancing_loss_func"
            raise UnsupportedModelError(
                f"{name}{where}: its router auxiliary loss is not the Switch-Transformer form E * sum(T * P) / N^2 "
                f"that streamed parts add up (on random logits it gives {want.item():.6g}, that form "
                f"{got.item():.6g}); set config.output_router_logits = False to stream, or raise the budget so the "
                "batch runs as one call"
            )


def router_aux_of(model: torch.nn.Module) -> RouterAux | None:
    """The router auxiliary loss a Hugging Face model adds to its loss, or None.

    None when ``config.output_router_logits`` is off or ``router_aux_loss_coef`` is 0 (the
    term is absent or multiplied by 0): an MoE model without it trains as any other.

    Raises:
        UnsupportedModelError: the model adds an auxiliary loss that cannot be reproduced
            here (no ``load_balancing_loss_func`` of the usual signature in its module, or no
            ``num_experts`` / ``num_experts_per_tok``); the message says what is missing.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    name = type(model).__name__
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    off = "set config.output_router_logits = False to train without the auxiliary loss"
    if coef is None:
        raise UnsupportedModelError(
            f"{name}: config.output_router_logits is on but no router_aux_loss_coef was found, so treecompile "
            f"cannot tell how the router auxiliary loss enters the loss; {off}"
        )
    if float(coef) == 0.0:
        return None
    fn = _module_attr(type(model), "load_balancing_loss_func")
    problems = []
    if fn is None:
        problems.append("its module defines no load_balancing_loss_func")
    elif tuple(inspect.signature(fn).parameters)[: len(AUX_LOSS_PARAMS)] != AUX_LOSS_PARAMS:
        problems.append(f"its load_balancing_loss_func does not take {AUX_LOSS_PARAMS}")
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int):
        problems.append("it has no integer num_experts / num_experts_per_tok attributes")
    if problems:
        raise UnsupportedModelError(
            f"{name}: the router auxiliary loss (router_aux_loss_coef={coef}) cannot be counted per path: "
            f"{'; '.join(problems)}. {off[0].upper()}{off[1:]}."
        )
    return RouterAux(loss_fn=fn, num_experts=experts, top_k=top_k, coef=float(coef))


def _module_attr(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is not None and hasattr(module, name):
            return getattr(module, name)
    return None


def check_moe_regions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Checks and accepts the experts and router-loss regions; removes their markers.

    Counters (``ctx.counters["check_moe_regions_pass"]``): ``experts``, ``router_aux_loss``, ``router_layers``.
    """
    for begin in [n for n in gm.graph.nodes if is_marker(n, "experts_begin")]:
        region, end = _region(begin, "experts_end", ctx.seq_len)
        _check_reads(region, begin, ctx, "experts")
        ctx.created.update(region)
        _unwrap(gm, begin, list(begin.args), end)
        ctx.count("experts")
    for begin in [n for n in gm.graph.nodes if is_marker(n, "router_stats_begin")]:
        region, end = _region(begin, "router_aux_end", ctx.seq_len)
        _check_reads(region, begin, ctx, "router auxiliary loss")
        logits, weights = begin.args
        weight_uses = {u for u in begin.users if _getitem_index(u) == len(logits)}
        _check_weighted(region, weight_uses, ctx)
        ctx.created.update(region)
        _unwrap(gm, begin, [*logits, weights], end)
        ctx.count("router_aux_loss")
        ctx.count("router_layers", len(logits))
    return gm


def _region(begin: fx.Node, end_name: str, seq: Any) -> tuple[set[fx.Node], fx.Node]:
    """The nodes between ``begin`` and its end marker, and the end marker.

    Everything computed from ``begin``'s outputs up to the end marker, plus the helpers
    (sizes, ``arange``, empty buffers) used only inside the region that read no tensor with
    a row dimension from outside it.
    """
    region: set[fx.Node] = set()
    ends: set[fx.Node] = set()
    stack = list(begin.users)
    while stack:
        n = stack.pop()
        if n in region or n in ends:
            continue
        if is_marker(n, end_name):
            ends.add(n)
            continue
        region.add(n)
        stack.extend(n.users)
    if len(ends) != 1:
        raise UnsupportedModelError(
            f"treecompile: {describe(begin)} should lead to one {end_name} marker, found {len(ends)}"
        )
    # Helpers: candidates are the inputs of region nodes; adding one makes its inputs candidates.
    candidates = [m for n in region for m in n.all_input_nodes]
    while candidates:
        n = candidates.pop()
        if n in region or n is begin or n.op in ("placeholder", "output", "get_attr"):
            continue
        if all(u in region for u in n.users) and not any(
            m not in region and _row_dims(m, seq) for m in n.all_input_nodes
        ):
            region.add(n)
            candidates.extend(n.all_input_nodes)
    return region, ends.pop()


def _check_reads(region: set[fx.Node], begin: fx.Node, ctx: PassContext, what: str) -> None:
    """Refuses a region that reads a tensor with a row dimension other than through ``begin``."""
    seq = ctx.seq_len
    for n in region:
        for m in n.all_input_nodes:
            if m in region or m is begin:
                continue
            v = value(m)
            if isinstance(v, torch.Tensor) and any(is_row_size(s, seq, "derived") for s in v.shape):
                raise UnsupportedModelError(
                    f"treecompile cannot make this model exact on a tree: the {what} region reads "
                    f"{describe(m)}, a sequence tensor that is not one of its inputs.\n  at {source_of(n)}"
                )


def _check_weighted(region: set[fx.Node], weights: set[fx.Node], ctx: PassContext) -> None:
    """Refuses a reduction over the rows in the router-loss region that ignores the weights."""
    seq = ctx.seq_len
    weighted: set[fx.Node] = set()
    for n in _topo(region):
        if n in weights or any(m in weights or m in weighted for m in n.all_input_nodes):
            weighted.add(n)
            continue
        if n.op not in ("call_function", "call_method"):
            continue
        reads_rows = any(_row_dims(m, seq) for m in n.all_input_nodes)
        if reads_rows and not _row_dims(n, seq):
            raise UnsupportedModelError(
                f"treecompile cannot count the router auxiliary loss per path: {describe(n)} reduces over the "
                "tokens without the row weights (the model's load_balancing_loss_func does not weight its "
                "statistics by attention_mask), so shared tokens would count once instead of once per path. "
                f"Set config.output_router_logits = False to train without it.\n  at {source_of(n)}"
            )


def _topo(nodes: set[fx.Node]) -> list[fx.Node]:
    if not nodes:
        return []
    graph = next(iter(nodes)).graph
    return [n for n in graph.nodes if n in nodes]


def _row_dims(node: fx.Node, seq: Any) -> bool:
    """Whether the node's value is a tensor (or tuple of tensors) with a dim derived from the rows."""
    v = value(node)
    vals = v if isinstance(v, (tuple, list)) else [v]
    return any(isinstance(t, torch.Tensor) and any(is_row_size(s, seq, "derived") for s in t.shape) for t in vals)


def _getitem_index(node: fx.Node) -> int | None:
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
        return node.args[1]
    return None


def _unwrap(gm: fx.GraphModule, begin: fx.Node, inputs: list[Any], end: fx.Node) -> None:
    """Removes a region's markers: their users read the marked tensors directly."""
    for user in list(begin.users):
        i = _getitem_index(user)
        if i is None:
            raise UnsupportedModelError(f"treecompile: {describe(user)} uses {describe(begin)} as a whole")
        user.replace_all_uses_with(inputs[i])
        gm.graph.erase_node(user)
    gm.graph.erase_node(begin)
    end.replace_all_uses_with(end.args[0])
    gm.graph.erase_node(end)
