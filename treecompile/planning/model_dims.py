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


def dims_of(config: Any, check: bool = True) -> ModelDims:
    """The `ModelDims` of a Hugging Face config (object or dict; see
    `treecompile.planning.budget.CostModel.from_config`).

    With ``check`` (for memory: without it, the dimensions as the keys give them), a
    ``PretrainedConfig`` is checked against a meta-device instance of its model (one decoder
    layer, no memory): q/k norms and projection biases are read from it, and a model whose
    weights differ from the dense decoder the cost model describes (more norms per layer, a
    recurrent layer, another MLP) is refused rather than under-counted. A dict without
    ``model_type``, or a `ModelDims`, is taken as the caller's description of the model.

    Raises:
        BudgetError: a missing key, a mixture-of-experts config, or a model the cost model
            does not describe.
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
    dims = ModelDims(
        layers=int(get("num_hidden_layers")),
        hidden=int(get("hidden_size")),
        intermediate=int(get("intermediate_size")),
        heads=heads,
        kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or get("hidden_size") // heads),
        vocab=int(get("vocab_size")),
        qk_norm=bool(get("qk_norm", False)),
        tied_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=bool(get("attention_bias", False)),
        mlp_bias=bool(get("mlp_bias", False)),
    )
    if not check:
        return dims
    if isinstance(config, Mapping):
        if "model_type" not in config:
            return dims
        try:
            from transformers import AutoConfig

            kwargs = {k: v for k, v in config.items() if k != "model_type"}
            config = AutoConfig.for_model(config["model_type"], **kwargs)
        except (ImportError, ValueError, KeyError, TypeError) as exc:
            raise BudgetError(f"model_type {config['model_type']!r}: transformers cannot build its config to check "
                              f"its layers ({exc}); {_NOT_DESCRIBED}") from None
    return _checked(config, dims)


#: Decoder layer kinds (a config's ``layer_types``) the cost model describes.
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})

_NOT_DESCRIBED = ("give the capacity in rows (budget_rows, --capacity) or describe the model with a "
                  "treecompile.planning.budget.ModelDims")


def _checked(config: Any, dims: ModelDims) -> ModelDims:
    """``dims`` with the q/k norms and projection biases of a meta-device instance of
    ``config``'s model (one decoder layer), after checking that its weights are those of the
    dense decoder the cost model describes (`ModelDims.num_parameters`, biases aside)."""
    import copy
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    arch = type(config).__name__.removesuffix("Config") or "the model"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYERS)
    if other:
        raise BudgetError(f"{arch} has {', '.join(other)} layers, which the cost model does not describe (attention "
                          f"and gated-MLP decoder layers only); {_NOT_DESCRIBED}")
    if getattr(config, "final_logit_softcapping", None):
        raise BudgetError(f"{arch} soft-caps its logits, which keeps [R, V] tensors the cost model does not count; "
                          f"{_NOT_DESCRIBED}")
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the model unchecked
        raise BudgetError(f"cannot build {arch} on the meta device to check its layers "
                          f"({type(exc).__name__}: {exc}); {_NOT_DESCRIBED}") from None
    layer = next((m[0] for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)), None)
    params = list(layer.named_parameters()) if layer is not None else []
    names = [n for n, _ in params]
    found = {
        "qk_norm": any("attn" in n and p.ndim == 1 and not n.endswith("bias") for n, p in params),
        "attention_bias": any("attn" in n and n.endswith("bias") for n in names),
        "mlp_bias": any("mlp" in n and n.endswith("bias") for n in names),
    }
    dims = dataclasses.replace(dims, **{k: bool(getattr(config, k, None)) or v for k, v in found.items()})
    weights = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("bias"))
    want = dataclasses.replace(dims, layers=1, attention_bias=False, mlp_bias=False).num_parameters
    if weights != want:
        raise BudgetError(
            f"{type(model).__name__} with one decoder layer holds {weights:,} weights where the dense decoder the cost "
            f"model describes (attention, q/k norms: {dims.qk_norm}, gated MLP, two norms a layer) holds {want:,}: it "
            f"has parts the cost model does not count (its layer's weights: {', '.join(names)}); {_NOT_DESCRIBED}")
    return dims
