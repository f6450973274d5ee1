"""The dimensions of a dense decoder-only transformer that the cost model
(`treecompile.planning.budget`) reads from a model's config, and its error."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BudgetError", "ModelDims", "dims_of"]


class BudgetError(ValueError):
    """A memory budget too small for even one token (or an invalid cost-model input)."""


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a dense decoder-only transformer the cost model needs.

    Attributes:
        layers, hidden, intermediate, heads, kv_heads, head_dim, vocab: as in HF configs.
        qk_norm: a norm on q and k per head before RoPE (Qwen3, Gemma3).
        tied_embeddings: the LM head shares the embedding matrix.
        attention_bias: q, k, v (and o) projections have biases.
        mlp_bias: the MLP projections have biases.
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool = False
    tied_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def num_parameters(self) -> int:
        """Parameters of the model (embeddings, layers, final norm, LM head unless tied)."""
        h, i, qd, kd = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * (qd + 2 * kd) + qd * h + (qd + 2 * kd if self.attention_bias else 0)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        head = 0 if self.tied_embeddings else self.vocab * h
        return self.vocab * h + self.layers * (attn + mlp + norms) + h + head


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def dims_of(config: Any) -> ModelDims:
    """The `ModelDims` of a Hugging Face config (object or dict; see
    `treecompile.planning.budget.CostModel.from_config`).

    Raises:
        BudgetError: a missing key, or a mixture-of-experts config.
    """
    get: Callable[[str, Any], Any]
    if isinstance(config, Mapping):
        get = lambda k, default=None: config.get(k, default)  # noqa: E731
    else:
        get = lambda k, default=None: getattr(config, k, default)  # noqa: E731
    missing = [k for k in _REQUIRED if get(k) is None]
    if missing:
        raise BudgetError(f"config lacks {', '.join(missing)}; the cost model needs {', '.join(_REQUIRED)}")
    if any(get(k) for k in _MOE_KEYS):
        raise BudgetError("mixture-of-experts configs are not modelled (dense attention + gated MLP only)")
    heads = int(get("num_attention_heads"))
    qk_norm = get("qk_norm")
    if qk_norm is None:
        qk_norm = False if isinstance(config, Mapping) else _detect_qk_norm(config)
    return ModelDims(
        layers=int(get("num_hidden_layers")),
        hidden=int(get("hidden_size")),
        intermediate=int(get("intermediate_size")),
        heads=heads,
        kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or get("hidden_size") // heads),
        vocab=int(get("vocab_size")),
        qk_norm=bool(qk_norm),
        tied_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=bool(get("attention_bias", False)),
        mlp_bias=bool(get("mlp_bias", False)),
    )


def _detect_qk_norm(config: Any) -> bool:
    """Whether the first decoder layer's attention holds 1-d weights (a q/k norm).

    Builds the model on the meta device (no memory) with at most one layer.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    for layers in (m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):
        return any(
            "attn" in name and p.ndim == 1 and not name.endswith("bias") for name, p in layers[0].named_parameters()
        )
    return False
