"""The router auxiliary loss of a Hugging Face MoE model, counted per path on a tree.

:func:`router_aux_of` finds the loss a model adds (its module's ``load_balancing_loss_func``,
``num_experts``, ``num_experts_per_tok``, ``router_aux_loss_coef``) and :class:`RouterAux`
calls it on the tree with each row weighted by ``path_count``, between the marker ops that
:func:`treecompile.passes.moe.check_moe_regions_pass` checks (why that is exact: that
module's docstring). Streamed calls add its per-part statistics (`RouterAux.tree_stats`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treecompile.core.errors import UnsupportedModelError
from treecompile.passes import markers  # noqa: F401  (registers the router marker ops)

__all__ = ["RouterAux", "router_aux_of", "AUX_LOSS_PARAMS"]


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
    if coef is None and _adds_own(type(model), "self.aux_loss_coef * aux_loss"):
        coef = getattr(model, "aux_loss_coef", None)  # JetMoE's name for it
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


def _adds_own(cls: type, line: str) -> bool:
    """Whether ``cls.forward``'s source has ``line`` (how the model adds its auxiliary loss)."""
    try:
        return line in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _module_attr(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is not None and hasattr(module, name):
            return getattr(module, name)
    return None
