"""The architecture zoo: tiny models of many families, each exact on a tree or refused.

Each `Case` builds a tiny float64 model with perturbed weights (no zero bias, no
identity norm: zero init hides wrong masks and dropped terms) and states what
``tree_compile`` must do with it:

* ``exact``: loss and every parameter gradient equal per-path training
  (:func:`treecompile.core.reference.per_path_loss`, the unmodified model run on each
  root-to-leaf path alone), to ``ZOO_TOLERANCE``, on two trees of different lengths;
* ``refused``: `UnsupportedModelError` whose first line contains ``reason``;
* ``xfail``: today silently wrong or crashing, for the class of bug named in ``reason``
  (the test is a strict xfail: it fails the day the case becomes exact, so the mark is
  removed with the fix).

`tests/test_zoo.py` runs the cases; `scripts/supported_models.py` writes
``docs/supported-models.md`` from the same table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import zoo_custom as zc

VOCAB = zc.VOCAB


@dataclass(frozen=True)
class Case:
    """One zoo model and what tree_compile must do with it.

    Attributes:
        id: test id and table key.
        what: one line for the docs (family, and what the case exercises).
        build: ``() -> nn.Module`` (float64, eval, perturbed).
        expect: ``"exact"``, ``"refused"`` or ``"xfail"``.
        reason: for ``refused``, a fragment of the error's first line; for ``xfail``, the
            class of bug.
        hf: a Hugging Face model (its source lives in transformers).
        attention: for an exact case, the attention rewrites it must show
            (``compiled.counters["rewrite_attention_pass"]``), so a spelling is known to be matched.
        since: the first transformers version ``(major, minor)`` that has the model.
        before: ``((major, minor), {field: value})``: the fields that differ on older versions.
        reference: ``reference(model)``, a context manager under which the per-path reference
            runs, for a model whose own kernel has no backward on CPU (FlexAttention): it must
            compute the same function (e.g. the causal FlexAttention by SDPA); None: the model as
            it is.
    """

    id: str
    what: str
    build: Callable[[], nn.Module]
    expect: str = "exact"
    reason: str = ""
    hf: bool = False
    attention: dict | None = None
    since: tuple[int, int] = (0, 0)
    before: tuple = ()
    reference: Callable | None = None

    def installed(self) -> Case:
        """The case as it holds on the installed transformers: ``before`` is ``((major, minor),
        {field: value})``, what differs on versions older than that (the fields above describe
        the newest, as the docs' table does)."""
        if self.before and transformers_version() < self.before[0]:
            return dataclasses.replace(self, **self.before[1])
        return self


def perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Gives every parameter non-trivial values, in place: matrices ``N(0, 1/fan_in)``,
    vectors (biases, norm weights, sinks, slopes) their value plus ``N(0, 0.1)``, so no
    bias is zero and no norm is the identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if p.dim() >= 2:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.add_(0.1 * noise)
    return model


def _custom(cls, **kw) -> Callable[[], nn.Module]:
    def build():
        torch.manual_seed(0)
        return perturb(cls(**kw).double().eval())

    return build


_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


#: A tiny DeepSeek sparse-attention config: MLA, 4 experts, an indexer keeping 4 keys per query
#: with 8 index heads (scores that tie at the 4th key are rare).
_DSA = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8, n_shared_experts=1, index_topk=4, index_head_dim=8, index_n_heads=8, head_dim=4,
            num_key_value_heads=4)


def _hf(config_name: str, model_name: str = "AutoModelForCausalLM", common: bool = True, built_in_float64=False,
        **kw):
    """``built_in_float64``: the model built with float64 as the default dtype, for one whose
    tables computed at construction (MiniMax's decays) would otherwise hold float32 rounding that
    no cast patch reaches."""
    def build():
        import transformers

        args = {**_COMMON, **kw} if common else kw
        config = getattr(transformers, config_name)(**args)
        torch.manual_seed(0)
        cls = getattr(transformers, model_name)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64 if built_in_float64 else default)
        try:
            model = cls.from_config(config) if model_name.startswith("Auto") else cls(config)
        finally:
            torch.set_default_dtype(default)
        if getattr(model.config, "_experts_implementation_internal", None) not in (None, "eager"):
            model.config._experts_implementation_internal = "eager"
        return perturb(model.double().eval())

    return build


def transformers_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(x) for x in version("transformers").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0,)


def _dense_flex(model):
    return zc.dense_flex_reference(model)


# GPT-J and CodeGen computed their own softmax attention until transformers 5.24, which moved
# both onto the attention interface.
_OWN_ATTENTION_BEFORE_5_24 = ((5, 24), {"attention": {"softmax_attention": 2}})

_OLD = dict(vocab_size=VOCAB)  # families with their own config names


CASES: list[Case] = [
    # ------------------------------------------------------------------ custom spellings
    Case("bmm-tril", "custom: bmm scores over [B*H, T, d], tril buffer [:T, :T], masked_fill",
         _custom(zc.BmmLM), attention={"softmax_attention": 2}),
    Case("baddbmm", "custom: Bloom-style baddbmm(beta=0, alpha=scale) scores",
         _custom(zc.BaddbmmLM), attention={"softmax_attention": 2}),
    Case("einsum", "custom: einsum scores and einsum output", _custom(zc.EinsumLM), attention={"softmax_attention": 2}),
    Case("multi-query-einsum", "custom: PaLM's multi-query einsums, key and value without a head dim "
         "('b h i d, b j d -> b h i j')", _custom(zc.MultiQueryEinsumLM), attention={"softmax_attention": 2}),
    Case("softmax-type-as", "custom: softmax(scores.float()).type_as(q)",
         _custom(zc.TypeAsLM), attention={"softmax_attention": 2}),
    Case("softmax-to-dtype", "custom: softmax(dtype=float32).to(q.dtype), additive triu(-inf) mask",
         _custom(zc.ToDtypeLM), attention={"softmax_attention": 2}),
    Case("masked-fill-triu", "custom: masked_fill(ones(T, T).triu(1), -inf)",
         _custom(zc.MaskedFillInfLM), attention={"softmax_attention": 2}),
    Case("gqa-keys-transposed", "custom (llm-foundry's torch attention): keys 'b s (h d) -> b h d s', two key heads "
         "repeat_interleave'd over four, q.matmul(k), ~tril cut [-s_q:, -s_k:] filled with finfo.min",
         _custom(zc.TransposedKeysLM), attention={"softmax_attention": 2}),
    Case("in-place-scores", "custom: att.masked_fill_(tril == 0, -inf) as a statement before the softmax",
         _custom(zc.InPlaceScoresLM), attention={"softmax_attention": 2}),
    Case("in-place-bias", "custom: a learned bias added to the scores in place (att.add_(bias[:T, :T]))",
         _custom(zc.InPlaceBiasLM), attention={"dense_pairs": 2}),
    Case("conv-slice-negative", "custom: depthwise conv1d(padding=K-1)[..., :-(K-1)] after attention",
         _custom(zc.CausalConvSliceLM)),
    Case("conv-act-cut", "custom (Mamba-2's mamba_simple.py): silu(conv1d(x^T, padding=K-1)^T)[:, :T] (the cut after "
         "the activation)", _custom(zc.ConvActCutLM)),
    Case("conv-act-cut-future", "the same cut [:, K-1:] (each row reads the rows after it)",
         _custom(zc.ConvActCutLM, cut_first=False), expect="refused", reason="is a convolution over the sequence"),
    Case("functional-conv", "custom: F.conv1d(x, w, b, padding=K-1, groups=C)[..., :-(K-1)], no nn.Conv1d module",
         _custom(zc.FunctionalConvLM)),
    Case("shift-tokens", "custom: x-transformers ShiftTokens((0, 1, 2)): F.pad(t, (0, 0, k, -k)) on feature slices",
         _custom(zc.ShiftTokensLM)),
    Case("cat-shift", "custom: token shift cat([x.new_zeros(b, 1, d), x[:, :-1]], dim=1) mixed into the input",
         _custom(zc.CatShiftLM)),
    Case("crop-pad-shift", "custom: shift by two as F.pad(x[:, :-2], (0, 0, 2, 0))", _custom(zc.CropPadShiftLM)),
    Case("roll-shift", "custom: token shift as roll(x, 1, dims=1) with prev[:, 0] = 0", _custom(zc.RollShiftLM)),
    Case("positions-none-index", "custom: learned positions [max_len, d] added as pos[None, :T, :]",
         _custom(zc.NoneIndexPositionsLM)),
    Case("length-branch", "custom: a Python branch on the sequence length that scales the embeddings "
         "(if T > 8: x = x * 0.5), the length never read as a value", _custom(zc.LengthBranchLM), expect="refused",
         reason="a Python branch of the model on the sequence length at zoo_custom.py"),
    Case("lazy-rope-cache", "TinyLlama / lit-gpt: a (cos, sin) cache over the block size built by the first call "
         "(self.rope_cache = build_rope_cache(block_size)), then cos[:T]", _custom(zc.LazyRopeCacheLM)),
    Case("fairseq-sinusoid", "fairseq SinusoidalPositionalEmbedding: the table built each call over "
         "padding_idx + 1 + T positions, read at cumsum(ids != pad) * mask + pad", _custom(zc.FairseqSinusoidLM)),
    Case("neox-rotary-table", "transformers 4.2x GPT-NeoX: cos_cached [1, 1, L, d] cut [:T, ...] on its size-1 "
         "leading dim (no cut), then squeeze(1).squeeze(0)[position_ids]", _custom(zc.NeoxRotaryLM)),
    Case("neox-baddbmm", "transformers 4.2x GPT-NeoX _attn: bool tril buffer [:, :, kl - ql : kl, :kl], baddbmm "
         "(beta=1, alpha=tensor(1.0) / norm_factor, a one-element buffer), where(mask, scores, finfo.min)",
         _custom(zc.NeoxBaddbmmLM), attention={"softmax_attention": 2}),
    Case("buffer-shift", "custom: token shift into a buffer, prev = zeros_like(x); prev[:, 1:] = x[:, :-1]",
         _custom(zc.BufferShiftLM)),
    Case("roll-masked-shift", "custom: shift by two as roll(x, 2, dims=1).masked_fill(arange(T)[None, :, None] < 2, 0)",
         _custom(zc.RollMaskedShiftLM)),
    Case("roll-masked-wrong", "custom: roll by two with a masked_fill of only the first row (arange(T) == 0)",
         _custom(zc.RollMaskedWrongLM), expect="refused", reason="reduces or reorders (roll) along the sequence"),
    Case("roll-shift-two", "custom: shift by two as x.roll(shifts=2, dims=1) with prev[:, :2] = 0",
         _custom(zc.RollShiftTwoLM)),
    Case("roll-no-zero", "custom: roll(x, 1, dims=1) kept whole (the first row reads the last)",
         _custom(zc.RollNoZeroLM), expect="refused", reason="reduces or reorders (roll) along the sequence"),
    Case("roll-wrong-zero", "custom: roll by two with only the first row zeroed (the second reads the last)",
         _custom(zc.RollWrongZeroLM), expect="refused", reason="reduces or reorders (roll) along the sequence"),
    Case("roll-read-first", "custom: roll(x, 1, dims=1) read before its first row is zeroed",
         _custom(zc.RollReadFirstLM), expect="refused", reason="reduces or reorders (roll) along the sequence"),
    Case("fill-shift", "custom: token shifts whose first row is a constant (ConstantPad1d((1, -1), 0.5)), a learned "
         "initial state (cat([x_prev0.expand(b, 1, d), x[:, :-1]])) or the first row (cat([x[:, :1], x[:, :-1]]))",
         _custom(zc.FillShiftLM)),
    Case("fill-conv", "custom: causal convs padded with the first row (Conv1d(padding_mode='replicate')[..., :T]) or "
         "a constant (F.conv1d(F.pad(x, (K - 1, 0), value=1.0))), and one cut after transposing back "
         "(conv(x.transpose(1, 2)).transpose(1, 2)[:, :T])", _custom(zc.FillConvLM)),
    Case("window", "custom: windows over the last 3 rows: avg_pool1d of a replicate-padded sequence, a running max "
         "over pad(..).unfold(-1, 3, 1), LightweightConv's unfold(1, 3, 1) taps", _custom(zc.WindowLM)),
    Case("reflect-conv", "custom: conv1d over F.pad(x, (K - 1, 0), mode='reflect') (reads later rows)",
         _custom(zc.ReflectConvLM), expect="refused", reason="changes the sequence length"),
    Case("last-row-shift", "custom: a shift whose first row reads the last, cat([x[:, -1:], x[:, :-1]])",
         _custom(zc.LastRowShiftLM), expect="refused", reason="changes the sequence length"),
    Case("mean-row-shift", "custom: a shift whose first row is the mean of the sequence, cat([x.mean(1), x[:, :-1]])",
         _custom(zc.MeanRowShiftLM), expect="refused", reason="reduces or reorders"),
    Case("average-attention", "OpenNMT-py AverageAttention: matmul(tril(ones) / arange(1, T + 1) mask in float32, "
         "expanded, cast; x), and tril(ones(T, T)) @ x", _custom(zc.MixingLM)),
    Case("length-mixing", "custom: (tril(ones(T, T)) / T) @ x, a running sum over the whole length",
         _custom(zc.LengthMixingLM), expect="refused", reason="different at another length"),
    Case("buffer-mixing", "custom: (tri[:T, :T] / arange(1, T + 1)[:, None]) @ x with tri a tril buffer",
         _custom(zc.BufferMixingLM), expect="refused", reason="reads a buffer"),
    Case("future-mixing", "custom: triu(ones(T, T)) @ x, a sum over the rows after each row",
         _custom(zc.FutureMixingLM), expect="refused", reason="not zero above the diagonal"),
    Case("first-token-reset", "Griffin's RG-LRU reset: segment_pos = arange(T); reset = segment_pos == 0 scales "
         "the first token of each path (a predicate on the position)", _custom(zc.FirstTokenResetLM)),
    Case("last-token-flag", "custom: arange(T) == T - 1 flags the last row of the packed sequence",
         _custom(zc.LastTokenFlagLM), expect="refused", reason="sequence length"),
    Case("cumsum-linear-attention", "custom: causal linear attention with running sums cumsum(phi(k) v^T) over the "
         "sequence", _custom(zc.CumsumLinearLM)),
    Case("mingru", "lucidrains/minGRU-pytorch: log-space scan with cumsum and logcumsumexp over the sequence, no "
         "attention", _custom(zc.MinGRULM)),
    Case("minlstm", "minLSTM (\"Were RNNs All We Needed?\"): log-space scan over a learned initial state in front "
         "of the values (cat([log h_0, v]), pad(cumsum(log f), (0, 0, 1, 0)), logcumsumexp), first row dropped",
         _custom(zc.MinLSTMLM)),
    Case("rooted-scan", "custom: cat([h0, v], 1).cumsum(1)[:, 1:], pad(g, (0, 0, 1, 0), value=2).cumprod(1)[:, -T:] "
         "and the exclusive pad(v, (0, 0, 1, 0)).cumsum(1)[:, :-1]",
         _custom(zc.RootedScanLM)),
    Case("token-root-scan", "custom: cat([x.mean(1), x], 1).cumsum(1)[:, 1:] (the row in front reads every token)",
         _custom(zc.TokenRootScanLM), expect="refused", reason="reduces or reorders (mean) along the sequence"),
    Case("smear", "nanochat / modded-nanogpt smear: cat([x[:, :1], x[:, 1:] + gate(x[:, 1:, :8]) * x[:, :-1]])",
         _custom(zc.SmearLM)),
    Case("smear-first-row", "custom: a smear whose later rows read the first row, x[:, :-1] * x[:, :1]",
         _custom(zc.SmearFirstLM), expect="refused", reason="changes the sequence length"),
    Case("running-mean", "custom: running mean cumsum(1) / arange(1, T + 1) before SDPA", _custom(zc.RunningMeanLM)),
    Case("running-window", "custom: a moving-window sum, c - F.pad(c, (0, 0, 3, 0))[:, :-3] with c = x.cumsum(1) "
         "(pad in front, then cut the end)", _custom(zc.RunningWindowLM)),
    Case("in-place-cumsum", "custom: a running sum in place, h = x.clone(); h.cumsum_(1)", _custom(zc.InPlaceCumsumLM)),
    Case("in-place-cumprod", "custom: a running product of a gate in place, g = 0.5 + 0.4 * tanh(x); g.cumprod_(1)",
         _custom(zc.InPlaceCumprodLM)),
    Case("running-max", "custom: cummax over the sequence, values and indices", _custom(zc.RunningMaxLM)),
    Case("flex-softcap", "attention-gym generate_tanh_softcap as the model's own flex_attention score_mod",
         _custom(zc.FlexSoftcapLM), reference=_dense_flex, attention={"flex_attention": 2, "flex_mods": 2}),
    Case("flex-alibi", "attention-gym generate_alibi_bias: slopes in a captured tensor, (kv_idx - q_idx) * slope",
         _custom(zc.FlexAlibiLM), reference=_dense_flex, attention={"flex_attention": 2, "flex_mods": 2}),
    Case("flex-length-window", "a sliding-window mask_mod closing over the length (q - kv < T // 2) in the model's "
         "own create_block_mask", _custom(zc.FlexLengthWindowLM), expect="refused",
         reason="computed from the sequence length"),
    Case("flex-chunked", "a chunked causal mask_mod (Llama 4's chunks of 4 tokens) in the model's own "
         "create_block_mask", _custom(zc.FlexChunkedLM), reference=_dense_flex, attention={"flex_attention": 2, "flex_mods": 2}),
    Case("flex-learned-bias", "a learned [H, 16] relative-position bias read by the score_mod (its gradient through "
         "the tree kernel)", _custom(zc.FlexLearnedBiasLM), reference=_dense_flex, attention={"flex_attention": 2, "flex_mods": 2}),
    Case("flex-per-head-window", "a mask_mod that reads the head (head h: a window of h + 2 keys)",
         _custom(zc.FlexPerHeadLM), reference=_dense_flex, attention={"flex_attention": 2, "flex_mods": 2}),
    Case("flex-head-bidirectional", "a mask_mod causal on head 0 only (the other heads see every token)",
         _custom(zc.FlexHeadBidirectionalLM), expect="refused", reason="not causal"),
    Case("flex-document-mask", "attention-gym's document mask: document_id[q_idx] == document_id[kv_idx], ids "
         "counted from the row's separator tokens", _custom(zc.FlexDocumentLM), expect="refused",
         reason="(e.g. document ids)"),
    Case("sdpa-tril-mask", "custom: SDPA with attn_mask = tril buffer [:T, :T]",
         _custom(zc.SdpaTrilMaskLM), attention={"sdpa": 2}),
    Case("vmap-mask", "custom: SDPA under a mask built with nested torch.vmap (as transformers 5.10 builds masks)",
         _custom(zc.VmapMaskLM), attention={"sdpa": 2}),
    Case("vmap-heads", "custom: a per-head gate under torch.vmap after SDPA",
         _custom(zc.VmapHeadsLM), attention={"sdpa": 2}),
    Case("complex-rope", "custom: RoPE by polar(arange(T) x inv) and view_as_complex", _custom(zc.ComplexRopeLM)),
    Case("complex-rope-table", "custom: complex freqs_cis table sliced [:T]", _custom(zc.ComplexRopeTableLM)),
    Case("alibi", "custom: ALiBi slope * (j - i) from arange(T)",
         _custom(zc.AlibiLM), attention={"softmax_attention": 2}),
    Case("alibi-abs", "custom: x-transformers' symmetric ALiBi -|j - i| * slope (not linear in j), a bias of the "
         "distance beside the causal mask", _custom(zc.AbsAlibiLM), attention={"softmax_attention": 2, "relative_bias": 2}),
    Case("alibi-btlm", "custom (cerebras BTLM): -|j - i| * slope added after the causal where(), in place, "
         "cast by bias.type_as(scores)", _custom(zc.BtlmAlibiLM), attention={"softmax_attention": 2, "relative_bias": 2}),
    Case("strided-mask", "custom (OpenAI's Sparse Transformer, strided heads): q >= k and (q - k) % 3 == 0 from "
         "two aranges, w * mask + -1e9 * (1 - mask): a mask_mod of the path distance",
         _custom(zc.PatternMaskLM), attention={"softmax_attention": 2, "distance_mask": 2}),
    Case("dilated-window-mask", "custom: masked_fill(~((q - k) % 2 == 0 & q - k < 6 & q >= k), -inf)",
         _custom(zc.PatternMaskLM, pattern="dilated"), attention={"softmax_attention": 2, "distance_mask": 2}),
    Case("chunked-arange-mask", "custom: the keys of the query's chunk of 4 (q // 4 == k // 4), by masked_fill: "
         "Llama 4's chunks of the path positions", _custom(zc.PatternMaskLM, pattern="chunked"),
         attention={"softmax_attention": 2, "chunk_mask": 2}),
    Case("sdpa-strided-mask", "custom: SDPA with the boolean attn_mask (q - k) % 3 == 0 & q >= k",
         _custom(zc.SdpaPatternMaskLM), attention={"sdpa": 2, "distance_mask": 2}),
    Case("sdpa-chunked-mask", "custom: SDPA with the boolean attn_mask q // 4 == k // 4 & q >= k",
         _custom(zc.SdpaPatternMaskLM, pattern="chunked"), attention={"sdpa": 2, "chunk_mask": 2}),
    Case("fixed-pattern-mask", "custom (Sparse Transformer's fixed heads): the query's chunk of 4 and every chunk's "
         "last key: a function of the two positions, kept dense", _custom(zc.PatternMaskLM, pattern="fixed"),
         attention={"dense_pairs": 2}),
    Case("half-length-mask", "custom: the keys less than T // 2 before the query (a window of the length)",
         _custom(zc.PatternMaskLM, pattern="half"), expect="refused",
         reason="a mask whose pattern changes with the sequence length"),
    Case("alibi-over-length", "custom: a bias (j - i) / T, linear in j but scaled by the row count",
         _custom(zc.LengthScaledAlibiLM), expect="refused",
         reason="an additive score bias computed from the sequence length"),
    Case("abs-bias-over-length", "custom: a bias -|j - i| * 4 / T, a function of the distance scaled by the row count",
         _custom(zc.LengthScaledAbsLM), expect="refused",
         reason="a bias over (query, key) pairs that changes with the sequence length"),
    Case("t5-bias", "custom: T5-style learned relative position bias (a table at clamp(i - j)), a score_mod on "
         "path distances", _custom(zc.T5BiasLM), attention={"softmax_attention": 2, "relative_bias": 2}),
    Case("t5-masked-bias", "Hugging Face T5's decoder: position_bias = compute_bias(..) + causal mask (finfo.min), "
         "then scores += position_bias", _custom(zc.T5MaskedBiasLM),
         attention={"softmax_attention": 2, "relative_bias": 2}),
    Case("t5-future-bias", "the same with a mask that blocks the earlier keys", _custom(zc.T5FutureBiasLM),
         expect="refused", reason="softmax"),
    Case("t5-buckets", "T5's compute_bias(bidirectional=False): log-spaced buckets into Embedding(buckets, H)",
         _custom(zc.T5BucketsLM), attention={"softmax_attention": 2, "relative_bias": 2}),
    Case("learned-alibi", "custom: ALiBi with learned slopes (a parameter), inside the scale",
         _custom(zc.LearnedAlibiLM), attention={"softmax_attention": 2, "relative_bias": 2}),
    Case("pointwise-conv", "custom: Conformer's pointwise Conv1d(kernel_size=1) on x.transpose(1, 2) and GLU: one "
         "token in, one out", _custom(zc.PointwiseConvLM), attention={"sdpa": 2}),
    Case("causal-convs-mixing-channels", "custom: a dilated causal Conv1d mixing channels (WaveNet) and a MADE-style "
         "masked centred conv1d", _custom(zc.FullCausalConvLM)),
    Case("rope-cache-4d-slice", "custom: rotary caches [1, 1, max_len, hd] sliced cache[:, :, :T, ...]",
         _custom(zc.FourDimRopeCacheLM)),
    Case("rope-cache-ellipsis-slice", "custom (apple/corenet OpenELM): rotary caches [1, 1, max_len, hd] sliced "
         "cache[..., k_len - q_len : k_len, :] and cache[..., :k_len, :]", _custom(zc.EllipsisRopeCacheLM)),
    Case("torch-decoder-layer-memory", "nn.TransformerDecoderLayer(tgt_is_causal=True) with a learned memory "
         "(cross-attention to keys without rows)", _custom(zc.TorchDecoderLayerLM),
         attention={"multihead_attention": 1, "memory_attention": 1}),
    Case("mha-memory-static-keys", "F.multi_head_attention_forward to a learned memory with static_k / static_v",
         _custom(zc.StaticKeysMemoryLM), expect="refused", reason="static keys"),
    Case("torch-decoder-layer-self", "nn.TransformerDecoderLayer over its own input: causal tgt_mask and "
         "memory_mask (keys from other rows of the sequence)", _custom(zc.TorchDecoderLayerLM, memory="input"),
         attention={"multihead_attention": 2}),
    Case("mha-bias-kv-zero-attn", "nn.MultiheadAttention(add_bias_kv=True, add_zero_attn=True) under a causal mask",
         _custom(zc.MHAExtraKeysLM), attention={"multihead_attention": 1}),
    Case("mha-zero-attn", "nn.MultiheadAttention(add_zero_attn=True) under a causal mask",
         _custom(zc.MHAExtraKeysLM, bias_kv=False), attention={"multihead_attention": 1}),
    Case("absolute-pair-bias", "custom: a learned bias of the distance plus the query's absolute position",
         _custom(zc.AbsolutePairBiasLM), attention={"dense_pairs": 2}),
    Case("sinks", "custom: gpt-oss-style attention sinks (a learned logit column)",
         _custom(zc.SinkLM), attention={"softmax_attention": 2}),
    Case("no-head-dim", "custom: 3-D attention on [B, T, D], no head dim",
         _custom(zc.NoHeadAttnLM), attention={"softmax_attention": 1}),
    Case("offset-positions", "custom: learned positions past an offset, pos[:, 2:T + 2] (OPT / fairseq padding "
         "offsets, ViT-style pos_embed[:, 1:T + 1])", _custom(zc.OffsetPositionsLM)),
    Case("tail-positions", "custom: the last T learned positions, pos[:, -T:] (they change with the length)",
         _custom(zc.OffsetPositionsLM, tail=True), expect="refused", reason="slices a tensor by the sequence length"),
    Case("wpe-16-long-tree", "custom: 16-entry position table, tree with more rows than positions",
         _custom(zc.WpeShortTableLM)),
    Case("tril-16-long-tree", "custom: 16-entry tril buffer sliced [:T, :T], tree with more rows than entries "
         "(the buffer is extended for the call; every path fits it)", _custom(zc.ShortTrilLM)),
    Case("rope-table-16-long-tree", "custom: 16-entry cos/sin tables sliced [:T], tree with more rows than entries",
         _custom(zc.ShortRopeTableLM)),
    Case("bool-mask-moe", "DeepSeek-MoE training path: y[flat_idx == i] = expert(h[flat_idx == i]) over "
         "repeat_interleave(k) copies (the mask computed twice)", _custom(zc.BoolMaskMoELM)),
    Case("bool-mask-moe-written", "the same with the routing indices written in place between the two masks",
         _custom(zc.BoolMaskMoEWrittenLM), expect="refused", reason="do not line up"),
    Case("inplace-moe", "custom: MoE accumulating experts with index_add_ into a buffer",
         _custom(zc.InplaceMoELM), expect="exact"),
    Case("mla-empty-copy", "custom: MLA keys written into new_empty(...) with copy_",
         _custom(zc.MlaEmptyLM), expect="exact"),
    Case("mla-empty-setitem", "custom: MLA keys written into new_empty(...) by slice assignment",
         _custom(zc.MlaEmptyLM, copy=False)),
    Case("inplace-residual", "custom: in-place residual x += attn(x)",
         _custom(zc.InplaceResidualLM), expect="exact"),
    Case("clamp-max-eps", "custom: element-wise torch.max(rms, eps) in a norm", _custom(zc.ClampMinNormLM)),
    Case("gather-shift", "custom: token shift as x[:, (arange(T) - 1).clamp(min=0)] (the row at the position before, "
         "an ancestor)", _custom(zc.GatherShiftLM)),
    Case("separator-gather", "custom: each token also reads the state at the last separator at or before it, "
         "x.gather(1, cummax(where(ids == SEP, arange(T), 0)))", _custom(zc.SeparatorGatherLM)),
    Case("next-row-gather", "custom: a token 7 reads the next row, x.gather(1, arange(T) + (ids == 7)) (a later row "
         "on the path: refused per batch where a path holds one)", _custom(zc.NextRowGatherLM), expect="refused",
         reason="reads, for a row, the path's row at position"),
    Case("linear-attn-parallel", "custom: causal linear attention in its parallel form, (phi(q) phi(k)^T) "
         "masked_fill(triu, 0) @ v (no softmax)", _custom(zc.QuadraticLinearLM), attention={"pair_sum": 2}),
    Case("linear-attn-tril", "custom: tril(q @ k^T) / sqrt(d) @ v", _custom(zc.TrilLinearLM),
         attention={"pair_sum": 2}),
    Case("linear-attn-normalised", "custom: normalised causal linear attention, (A @ v) / (A.sum(-1) + eps)",
         _custom(zc.NormalisedLinearLM), attention={"pair_sum": 2}),
    Case("linear-attn-normalised-before", "custom: normalised causal linear attention, A / A.sum(-1).clamp(eps) @ v",
         _custom(zc.NormalisedLinearLM, before=True, clamp=True), attention={"pair_sum": 2}),
    Case("retnet-parallel", "custom: RetNet parallel retention, torchscale's decay mask gamma ** (i - j) (unnormalised)",
         _custom(zc.RetentionLM), attention={"pair_sum": 2}),
    Case("retnet-learned-decay", "custom: RetNet parallel retention with the decay rate a parameter per head",
         _custom(zc.RetentionLM, learned=True), attention={"pair_sum": 2}),
    Case("retnet-normalised", "custom: RetNet parallel retention with torchscale's row normalisations: the mask "
         "by the square root of its row sums, the scores by their detached absolute row sums clamped to [1, 5e4]",
         _custom(zc.RetentionLM, normalised=True), attention={"pair_sum": 2}),
    Case("forgetting-transformer", "custom: the Forgetting Transformer's scores + c_i - c_j, c a running sum of "
         "log forget gates over the sequence", _custom(zc.ForgettingLM), attention={"softmax_attention": 2}),
    Case("key-gate-bias", "custom: a bias per key read from its token, before the scale, one per head",
         _custom(zc.KeyGateLM), attention={"softmax_attention": 2}),
    Case("key-gate-bias-shared", "custom: a bias per key read from its token, shared by the heads, subtracted after "
         "the scale", _custom(zc.KeyGateLM, bias_heads=1, subtract=True), attention={"softmax_attention": 2}),
    Case("key-gate-bias-mqa", "custom: a bias per key read from its token, per head, over one key and value head "
         "the products broadcast", _custom(zc.KeyGateLM, mqa=True), attention={"softmax_attention": 2}),
    Case("key-gate-bias-softcap", "custom: a bias per key read from its token outside a soft-cap",
         _custom(zc.KeyGateCapLM), attention={"dense_pairs": 2}),
    Case("key-padding-fill", "custom: a key padding mask from the ids (ids != pad), masked_fill(-inf) after the causal "
         "one", _custom(zc.PaddedLM), attention={"softmax_attention": 2}),
    Case("key-padding-sdpa", "custom: SDPA with attn_mask = causal & (ids != pad) per key", _custom(zc.PaddingSdpaLM),
         attention={"sdpa": 2}),
    Case("key-padding-sdpa-bias", "custom: SDPA with a float attn_mask, an additive causal mask plus -1e9 on padded "
         "keys", _custom(zc.PaddingSdpaLM, form="bias"), attention={"sdpa": 2}),
    Case("key-padding-extended", "custom: BERT's extended mask (1 - keep) * -10000 per key added to the scores",
         _custom(zc.ExtendedMaskLM), attention={"softmax_attention": 2}),
    Case("encoder-layer-padding", "torch: nn.TransformerEncoderLayer with a causal mask and a "
         "src_key_padding_mask from the ids", _custom(zc.EncoderLayerPaddingLM),
         attention={"multihead_attention": 2}),
    Case("key-padding-sdpa-alone", "custom: SDPA with a key padding mask and no causal mask (bidirectional)",
         _custom(zc.PaddingSdpaLM, form="alone"), expect="refused", reason="attn_mask is read from the tokens alone"),
    Case("diff-transformer", "microsoft/unilm Diff-Transformer: two softmax maps per head combined p0 - lam * p1 "
         "before @ v (float32 softmax)", _custom(zc.DiffLM), attention={"softmax_attention": 2}),
    Case("talking-heads", "x-transformers: pre-softmax talking heads, Conv2d(heads, heads, 1) on the scaled scores",
         _custom(zc.TalkingHeadsLM), attention={"softmax_attention": 2}),
    Case("talking-heads-einsum", "custom: talking heads as einsum('b h i j, h g -> b g i j', sim, W)",
         _custom(zc.TalkingHeadsLM, form="einsum"), attention={"softmax_attention": 2}),
    Case("talking-heads-mqa", "custom: talking heads over one key and value head expanded to every head",
         _custom(zc.TalkingHeadsLM, form="mqa"), attention={"softmax_attention": 2}),
    Case("talking-heads-both", "x-transformers: pre- and post-softmax talking heads (the probabilities mixed "
         "across heads before @ v too)", _custom(zc.TalkingHeadsLM, form="both"), attention={"softmax_attention": 2}),
    Case("talking-heads-post", "x-transformers: post-softmax talking heads alone",
         _custom(zc.TalkingHeadsLM, form="post"), attention={"softmax_attention": 2}),
    Case("talking-heads-masked-first", "custom: the causal mask applied before the heads are mixed (mixed too)",
         _custom(zc.TalkingHeadsLM, form="masked-first"), expect="refused",
         reason="before their heads are mixed"),
    Case("cosine-logit-scale", "Swin V2: cosine attention times a learned logit scale per head",
         _custom(zc.LogitScaleLM), attention={"softmax_attention": 2}),
    Case("scalable-softmax", "Scalable-Softmax: the scores times s * log(n) per query (n from arange)",
         _custom(zc.ScalableSoftmaxLM), attention={"softmax_attention": 2}),
    Case("learned-temperature", "custom: the scores divided by a learned temperature per head",
         _custom(zc.ScalableSoftmaxLM, temperature=True), attention={"softmax_attention": 2}),
    Case("memory-kv", "lucidrains/x-transformers num_mem_kv: learned memory keys and values concatenated before "
         "the sequence's, the causal mask padded", _custom(zc.MemoryKVLM), attention={"softmax_attention": 2}),
    Case("memory-kv-sdpa", "custom: memory keys and values with SDPA and the padded boolean mask",
         _custom(zc.MemoryKVLM, sdpa=True), attention={"sdpa": 2}),
    Case("memory-kv-masked", "custom: memory keys and values the first query may not read",
         _custom(zc.MemoryKVLM, masked=True), expect="refused", reason="a mask or bias on the memory keys"),
    Case("length-decay", "custom: a decay mask divided by the sequence length", _custom(zc.LengthDecayLM),
         expect="refused", reason="changes with the sequence length"),
    Case("linear-attn-bidirectional", "custom: linear attention without a causal mask",
         _custom(zc.BidirectionalLinearLM), expect="refused",
         reason="sums values over keys it does not ignore off the path"),
    Case("range-positions", "custom: RoPE positions from q.new_tensor(range(T)) (a Python range of the length)",
         _custom(zc.RangeRopeLM), expect="refused",
         reason="in attend (`ang = torch.outer(q.new_tensor(range(q.shape[2]))"),
    Case("length-norm-pos", "custom: positions arange(T) / T",
         _custom(zc.LengthNormPosLM), expect="refused", reason="uses the sequence length as a value"),
    Case("checkpoint", "custom: blocks under torch.utils.checkpoint",
         _custom(zc.CheckpointLM), expect="exact"),
    # ------------------------------------------------------------------ Hugging Face
    Case("gptj", "GPT-J: interleaved partial RoPE (own attention before transformers 5.24)", hf=True,
         build=_hf("GPTJConfig", common=False, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                   n_positions=64, bos_token_id=0, eos_token_id=0), attention={"hf_interface": 2},
         before=_OWN_ATTENTION_BEFORE_5_24),
    Case("codegen", "CodeGen: fused qkv, partial RoPE (own attention before transformers 5.24)", hf=True,
         build=_hf("CodeGenConfig", common=False, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                   n_positions=64, n_ctx=64, bos_token_id=0, eos_token_id=0), attention={"hf_interface": 2},
         before=_OWN_ATTENTION_BEFORE_5_24),
    Case("falcon-alibi", "Falcon: ALiBi", hf=True,
         build=_hf("FalconConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=4, alibi=True, bos_token_id=0, eos_token_id=0), attention={"sdpa": 2}),
    Case("falcon-rotary", "Falcon: rotary, multi-query", hf=True,
         build=_hf("FalconConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=4, alibi=False, multi_query=True, bos_token_id=0, eos_token_id=0),
                   attention={"sdpa": 2}),
    Case("falcon-new-arch", "Falcon: new decoder architecture (GQA, parallel attention)", hf=True,
         build=_hf("FalconConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, alibi=False,
                   bos_token_id=0, eos_token_id=0), attention={"sdpa": 2}),
    Case("mpt", "MPT: ALiBi, own attention", hf=True,
         build=_hf("MptConfig", common=False, vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=64),
         attention={"softmax_attention": 2}),
    Case("bloom", "Bloom: ALiBi through baddbmm", hf=True,
         build=_hf("BloomConfig", common=False, vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                   bos_token_id=0, eos_token_id=0), attention={"softmax_attention": 2}),
    Case("gpt-neo", "GPT-Neo: alternating global / local attention", hf=True,
         build=_hf("GPTNeoConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                   attention_types=[[["global", "local"], 1]], window_size=4, max_position_embeddings=64,
                   bos_token_id=0, eos_token_id=0), attention={"softmax_attention": 2}),
    Case("gpt-neox", "GPT-NeoX: partial RoPE, parallel residual", hf=True,
         build=_hf("GPTNeoXConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=4, intermediate_size=64, rotary_pct=0.5, max_position_embeddings=64,
                   bos_token_id=0, eos_token_id=0)),
    Case("opt", "OPT: learned positions with offset 2", hf=True,
         build=_hf("OPTConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=4, ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32,
                   bos_token_id=0, eos_token_id=0, pad_token_id=1)),
    Case("phi", "Phi: partial RoPE, parallel block", hf=True,
         build=_hf("PhiConfig", num_hidden_layers=1, partial_rotary_factor=0.5, bos_token_id=0, eos_token_id=0)),
    Case("phi3", "Phi-3: fused qkv, RoPE", hf=True, build=_hf("Phi3Config", num_hidden_layers=1, pad_token_id=0)),
    Case("stablelm", "StableLM: partial RoPE, qkv bias", hf=True,
         build=_hf("StableLmConfig", num_hidden_layers=1, partial_rotary_factor=0.5, use_qkv_bias=True)),
    Case("olmo2", "OLMo-2: q/k norms", hf=True, build=_hf("Olmo2Config", num_hidden_layers=1, pad_token_id=0)),
    Case("gemma3-text", "Gemma-3 text: sliding / global layers, q/k norms", hf=True,
         build=_hf("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"])),
    Case("cohere2", "Cohere-2: sliding layers, parallel block", hf=True,
         build=_hf("Cohere2Config", sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                   pad_token_id=0)),
    Case("starcoder2", "StarCoder-2: sliding window, biases", hf=True,
         build=_hf("Starcoder2Config", num_hidden_layers=1, sliding_window=4)),
    Case("persimmon", "Persimmon: q/k layer norms, partial RoPE", hf=True,
         build=_hf("PersimmonConfig", common=False, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)),
    Case("biogpt", "BioGPT: learned positions", hf=True,
         build=_hf("BioGptConfig", common=False, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)),
    # Its decoder self-attention leaves is_causal unset: causal by the mask it is handed.
    Case("bigbird-pegasus", "BigBird-Pegasus decoder: causal by its mask (is_causal left False)", hf=True,
         build=_hf("BigBirdPegasusConfig", "BigBirdPegasusForCausalLM", common=False, vocab_size=VOCAB, d_model=32,
                   decoder_layers=2, decoder_ffn_dim=64, decoder_attention_heads=4, encoder_layers=1,
                   encoder_ffn_dim=64, encoder_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                   bos_token_id=0, eos_token_id=0, decoder_start_token_id=0),
         attention={"hf_interface": 2}),
    Case("gpt2-16-positions", "GPT-2 with 16 positions, on a tree of 35 rows whose paths fit", hf=True,
         build=_hf("GPT2Config", common=False, vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                   bos_token_id=0, eos_token_id=0)),
    Case("opt-16-positions", "OPT with 16 positions (offset 2), on a tree of 35 rows", hf=True,
         build=_hf("OPTConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                   num_attention_heads=4, ffn_dim=64, max_position_embeddings=16, word_embed_proj_dim=32,
                   bos_token_id=0, eos_token_id=0, pad_token_id=1)),
    Case("gpt-bigcode", "GPT-BigCode: multi-query attention", hf=True,
         build=_hf("GPTBigCodeConfig", common=False, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                   n_positions=64, bos_token_id=0, eos_token_id=0)),
    # Before transformers 5.13 CTRL builds its mask as triu(ones(S, S)) * -1e4, added to the scores.
    Case("ctrl", "CTRL: sinusoidal positions, own attention (its mask an additive triu(ones(S, S)) * -1e4 before "
         "transformers 5.13)", hf=True,
         build=_hf("CTRLConfig", common=False, vocab_size=VOCAB, n_embd=32, dff=64, n_layer=2, n_head=4,
                   n_positions=64)),
    Case("gpt-neox-japanese", "GPT-NeoX-Japanese: own attention, baddbmm onto a zero tensor (an additive term of "
         "zeros beside the causal mask)", hf=True,
         build=_hf("GPTNeoXJapaneseConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=4, intermediate_multiple_size=2, bos_token_id=0, eos_token_id=0)),
    Case("mixtral", "Mixtral: sparse MoE", hf=True,
         build=_hf("MixtralConfig", num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2)),
    Case("qwen2-moe", "Qwen2-MoE: MoE with a shared expert", hf=True,
         build=_hf("Qwen2MoeConfig", num_hidden_layers=1, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                   num_experts_per_tok=2)),
    Case("olmoe", "OLMoE: MoE, q/k norms", hf=True,
         build=_hf("OlmoeConfig", num_hidden_layers=1, num_experts=4, num_experts_per_tok=2, pad_token_id=0)),
    Case("granite", "Granite: multipliers on embeddings, residuals, logits", hf=True,
         build=_hf("GraniteConfig", num_hidden_layers=1, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0,
                   attention_multiplier=0.3)),
    Case("llama4-text", "Llama-4 text: chunked attention (chunks of 4 along the path), MoE, NoPE layers", hf=True,
         build=_hf("Llama4TextConfig", "Llama4ForCausalLM", head_dim=8, intermediate_size_mlp=64,
                   num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=4, interleave_moe_layer_step=1,
                   no_rope_layers=[1, 0], pad_token_id=0), attention={"hf_interface": 2}),
    Case("deepseek-v3", "DeepSeek-V3: MLA and MoE", hf=True,
         build=_hf("DeepseekV3Config", moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                   n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8,
                   qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_shared_experts=1),
                   expect="exact"),
    Case("gpt-oss", "gpt-oss: attention sinks, sliding layers, MoE", hf=True,
         build=_hf("GptOssConfig", head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"]),
         expect="exact"),
    Case("jamba-attn-moe", "Jamba: attention-only layers with MoE", hf=True,
         build=_hf("JambaConfig", num_experts=4, num_experts_per_tok=2, attn_layer_period=1, attn_layer_offset=0,
                   expert_layer_period=1, expert_layer_offset=0, use_mamba_kernels=False)),
    Case("jamba-attn-moe-aux", "Jamba: MoE with the router auxiliary loss", hf=True,
         build=_hf("JambaConfig", num_experts=4, num_experts_per_tok=2, attn_layer_period=1, attn_layer_offset=0,
                   expert_layer_period=1, expert_layer_offset=0, use_mamba_kernels=False, output_router_logits=True,
                   router_aux_loss_coef=0.5)),
    # DBRX's experts loop over the experts a batch hits, outside Hugging Face's experts interface:
    # a drop-in runs them as the interface does. Before transformers 5.15 its forward reshaped the
    # hidden states by the experts' inner size, which the drop-in does not repeat.
    Case("dbrx", "DBRX: fused MoE whose experts loop over the experts hit (a drop-in), clipped qkv", hf=True,
         build=_hf("DbrxConfig", common=False, vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=1, max_seq_len=64,
                   attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                   ffn_config={"moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 32}),
         before=((5, 15), {"expect": "refused", "reason": "treecompile cannot capture this model"})),
    # JetMoE's router reads its experts' group sizes as Python numbers; drop-ins run its MoE and
    # its mixture of attention heads (query and output projections per expert) by grouped products.
    Case("jetmoe", "JetMoE: MoE and a mixture of attention heads whose router splits by group sizes (drop-ins)",
         hf=True, build=_hf("JetMoeConfig", num_local_experts=4, num_experts_per_tok=2, kv_channels=8,
                            num_key_value_heads=2), attention={"hf_interface": 2}),
    Case("jetmoe-aux", "JetMoE with the router auxiliary loss (its router's logits recorded through the drop-in)",
         hf=True, build=_hf("JetMoeConfig", num_local_experts=4, num_experts_per_tok=2, kv_channels=8,
                            num_key_value_heads=2, output_router_logits=True, aux_loss_coef=0.5)),
    # ZAYA's compressed convolutional attention: two convs over one left padding and a value
    # delayed by one token (the delayed projection of zeros before the first): a drop-in writes
    # both in the passes' causal forms with the same values.
    Case("zaya", "ZAYA: q/k mixed by two causal convs over one padding, a delayed value, MoE (a drop-in)",
         hf=True, since=(5, 13),
         build=_hf("ZayaConfig", num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                   num_experts_per_tok=1, router_hidden_size=16, cca_time0=2, cca_time1=3, attention_bias=True,
                   pad_token_id=0, bos_token_id=0, eos_token_id=0),
         attention={"hf_interface": 2}),
    # DeepSeek sparse attention: an indexer scores every key per query from the causal mask it
    # reads, keeps the top 4, and the attention's mask keeps those: dense [S, S] on the tree.
    Case("deepseek-v32", "DeepSeek-V3.2: sparse attention, an indexer choosing each query's top-k keys", hf=True,
         since=(5, 11), build=_hf("DeepseekV32Config", **_DSA, num_hidden_layers=1),
         attention={"dense_pairs": 2}),
    # Eager: the chosen keys' mask is the causal float mask filled with the dtype's lowest number,
    # added to the scores before a softmax (exact where each query sees a key: checked per batch).
    Case("deepseek-v32-eager", "DeepSeek-V3.2 with eager attention: a float mask of the chosen keys", hf=True,
         since=(5, 11), build=_hf("DeepseekV32Config", **_DSA, num_hidden_layers=1, attn_implementation="eager"),
         attention={"dense_pairs": 2}),
    # Before 5.17 its indexer adds SDPA's boolean mask to the scores (+1 on the path, +0 off it):
    # keys off the path compete with the path's (per path the future's do), refused.
    Case("glm-moe-dsa", "GLM-MoE-DSA: sparse attention whose second layer reuses the first's chosen keys", hf=True,
         build=_hf("GlmMoeDsaConfig", **_DSA, indexer_types=["full", "shared"], mlp_layer_types=["dense", "sparse"]),
         attention={"dense_pairs": 3},
         before=((5, 17), {"expect": "refused", "reason": "the model's own code reads the attention mask built by",
                           "attention": None})),
    # Hunyuan-V4: the indexer's chosen keys in a mask sized by the keys (a tensor the model writes
    # in place), eager attention with a sink column and the row maximum subtracted.
    Case("hy-v4", "Hunyuan-V4: sparse attention with sinks (a sink column beside the scores), eager", hf=True,
         since=(5, 24), build=_hf("HYV4Config", **{**_DSA, "index_n_heads": 16}, hc_mult=4,
                                   layer_types=["indexed_attention", "indexed_attention"],
                                   mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"], pad_token_id=0,
                                   bos_token_id=0, eos_token_id=0),
         attention={"dense_pairs": 4}),
    # One index head with a ReLU: many keys score 0, and which tied key torch.topk keeps changes
    # with the row's length (per path too); a batch where a query's choice is such a tie is refused.
    Case("deepseek-v32-ties", "DeepSeek-V3.2 with one index head: tied scores at the k-th key", hf=True,
         since=(5, 11), build=_hf("DeepseekV32Config", **{**_DSA, "index_n_heads": 1}, num_hidden_layers=1),
         expect="refused", reason="are a choice among tied scores"),
    # Doge's own code reads the causal mask it is handed (its dynamic mask adds a gate per key to
    # it): captured with Hugging Face's own mask, the gate rides in the tree kernel's product.
    # Before transformers 5.18 it let SDPA skip that mask, so its SDPA attention saw later tokens.
    Case("doge", "Doge: dynamic mask (a gate per key added to the causal mask it reads, repeated over the query "
         "heads), SDPA", hf=True,
         build=_hf("DogeConfig", head_dim=8), attention={"sdpa": 2},
         before=((5, 18), {"expect": "refused", "reason": "the model's own code reads the attention mask built by",
                           "attention": None})),
    Case("doge-eager", "Doge with its eager attention (the dynamic mask added to the scores)", hf=True,
         build=_hf("DogeConfig", head_dim=8, attn_implementation="eager"), attention={"softmax_attention": 2}),
    Case("deepseek-v2", "DeepSeek-V2: MLA, complex RoPE, MoE", hf=True,
         build=_hf("DeepseekV2Config", moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                   first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                   v_head_dim=8, n_shared_experts=1, n_group=1, topk_group=1), expect="exact"),
    # MiniMax's lightning attention loops over blocks of the sequence; a drop-in writes it in its
    # parallel form (a decay of i - j on the scores), which the pair sum runs over the ancestors.
    Case("minimax", "MiniMax: lightning (linear) attention layers (blocks of 4) beside a softmax layer, MoE",
         hf=True, build=_hf("MiniMaxConfig", head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], block_size=4,
                            built_in_float64=True)),
    Case("minimax-m2", "MiniMax-M2: MoE routed by sigmoid scores with a correction bias, q/k norms over all heads, "
         "partial rotary", hf=True, build=_hf("MiniMaxM2Config", num_local_experts=4, num_experts_per_tok=2, head_dim=8)),
    Case("longcat-flash", "LongCat-Flash: MLA, MoE with zero-compute (identity) experts beside the routed ones, its "
         "experts a loop over the experts hit (a drop-in)", hf=True,
         build=_hf("LongcatFlashConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                   qk_nope_head_dim=4, v_head_dim=8, head_dim=4, n_routed_experts=4, zero_expert_num=2,
                   num_experts_per_tok=2, moe_topk=2, expert_ffn_hidden_size=16, ffn_hidden_size=64,
                   max_position_embeddings=64)),
    Case("inkling", "Inkling: a relative position bias read from the tokens (relative logits gathered at the "
         "distance, zero past rel_extent) handed to attention as position_bias, log-scaled queries and bias, "
         "hybrid sliding layers, MoE", hf=True,
         build=_hf("InklingTextConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
                   swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4, d_rel=4, rel_extent=4,
                   log_scaling_n_floor=4, max_position_embeddings=64, intermediate_size=64, moe_intermediate_size=16,
                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, pad_token_id=0, bos_token_id=0,
                   eos_token_id=0), since=(5, 24)),
    Case("inkling2", "Inkling 2: the relative bias beside a sink logit per query token, and an attention over the "
         "blocks' states at each token (not over the tokens)", hf=True,
         build=_hf("Inkling2TextConfig", common=False, vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4,
                   d_rel=4, rel_extent=4, log_scaling_n_floor=4, max_position_embeddings=64, moe_intermediate_size=16,
                   n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1, pad_token_id=0,
                   bos_token_id=0, eos_token_id=0, use_cache=False), since=(5, 24)),
    Case("openai-gpt", "GPT-1: its tril buffer cut to the scores as w * b + -1e4 * (1 - b), plus the attention mask "
         "the model is handed (an arithmetic mask that cannot be built at another length)", hf=True,
         build=_hf("OpenAIGPTConfig", common=False, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    Case("recurrent-gemma", "RecurrentGemma: RG-LRU recurrence", hf=True,
         build=_hf("RecurrentGemmaConfig", common=False, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=1, num_attention_heads=4, lru_width=32, attention_window_size=8,
                   block_types=["recurrent"]), expect="refused", reason="sequence length a constant"),
    Case("rwkv", "RWKV-4: token shift (ZeroPad2d), WKV by rwkv_linear_attention (its CPU loop over the tokens, "
         "stabilised by a running maximum)", hf=True,
         build=_hf("RwkvConfig", common=False, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                   attention_hidden_size=32, intermediate_size=64, context_length=64, rescale_every=0)),
]

BY_ID = {c.id: c for c in CASES}


def all_cases() -> list[Case]:
    """The zoo's own cases, then the models written as public repositories write them
    (``tests/zoo_repos``)."""
    import zoo_repos

    return CASES + zoo_repos.CASES


# ---------------------------------------------------------------------- running a case

#: Two trees of different lengths (two different structures): shared prefixes, a 1-token
#: node, a path ending inside another, a duplicate path, a forest; the second has more rows
#: (26) than a 16-entry position table while its longest path has 9 tokens.
TREES = {
    "branchy": [[[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6], [1, 2, 5], [1, 7, 8, 9, 10, 11]]],
    "wide": [[[3, 4, 5] + [6 + i, 7 + i, 8 + i] + ([20 + i] * (i % 3)) for i in range(6)],
             [[9, 10], [9, 11, 12, 13, 14, 15, 16]]],
}


def batches():
    import treecompile as tc

    out = []
    for name, forest in TREES.items():
        trees = [tc.TrajectoryTree.from_sequences(paths) for paths in forest]
        out.append((name, tc.pack(trees), trees))
    return out


def compare(model: nn.Module, compiled, batch, trees, reference: Callable | None = None,
            after_tree: Callable[[], None] | None = None, rel: float | None = None) -> dict:
    """Loss, per-path log-probs and every gradient of the tree vs per-path training;
    ``after_tree`` runs after the tree call and its backward, before the per-path reference.

    Returns ``{"loss": rel diff, "grad": worst scaled diff, "param": its name}``; raises
    AssertionError naming what differs beyond ``rel`` (default ``ZOO_TOLERANCE``).
    """
    from testing import ZOO_TOLERANCE, backward_grads

    from treecompile.core.reference import per_path_loss

    out, tree_grads = backward_grads(model, lambda: compiled(batch))
    if after_tree is not None:
        after_tree()
    router = getattr(compiled, "_router_aux", None)
    coef = None if router is None else router.coef
    with reference(model) if reference is not None else contextlib.nullcontext():
        ref, ref_grads = backward_grads(model, lambda: per_path_loss(model, trees, router_aux_loss_coef=coef))
    rel = ZOO_TOLERANCE if rel is None else rel
    loss_diff = abs(out.loss.item() - ref.loss.item()) / max(abs(ref.loss.item()), 1e-30)
    assert loss_diff <= rel, f"loss {out.loss.item():.10g} vs per path {ref.loss.item():.10g} (rel {loss_diff:.3e})"
    for i in range(batch.num_paths):
        torch.testing.assert_close(out.logprobs.detach()[batch.path_rows(i)], ref.logprobs[i].detach(),
                                   rtol=rel, atol=rel, msg=lambda m, i=i: f"logprobs of path {i}: {m}")
    differ = tree_grads.keys() ^ ref_grads.keys()
    assert not differ, f"gradients cover different parameters: {sorted(differ)}"
    # A parameter whose true gradient is 0 by symmetry (a key bias shifts every score of a
    # query alike, and softmax ignores that) has a per-path gradient of rounding noise;
    # relative to itself that noise is 100%. Gradients are compared on at least ``rel`` of the
    # model's largest; one that vanishes (below 1e-9 of the largest) may differ by float64
    # rounding at the largest's scale, 1e-12 of it (at ``rel`` 1e-6 that is the same bound).
    largest = max(g.abs().max().item() for g in ref_grads.values())
    worst = 0.0
    for name, r in ref_grads.items():
        scale = max(r.abs().max().item(), rel * largest)
        if r.abs().max().item() < 1e-9 * largest:
            scale = max(scale, 1e-12 / rel * largest)
        err = (tree_grads[name] - r).abs().max().item() / scale
        worst = max(worst, err)
        assert err <= rel, (
            f"gradient of {name}: max |diff| {err * scale:.3e}, scale {scale:.3e} -> {err:.3e} > {rel:.0e}"
        )
    return {"loss": loss_diff, "grad": worst}


def assert_unchanged(model: nn.Module, twin: nn.Module, lengths: tuple[int, ...]) -> None:
    """``model`` run on its own gives the logits of ``twin`` (an untouched copy) at each length
    of ``lengths``, and holds the same parameters; a length the model cannot run (past its
    position table) is skipped."""
    from treecompile.core.reference import model_logits

    for name, p in twin.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), f"parameter {name} changed"
    for T in lengths:
        ids = (torch.arange(T)[None] * 7 + 3) % VOCAB
        try:
            with torch.no_grad():
                expected = model_logits(twin, ids)
        except (IndexError, RuntimeError):  # longer than the model's table
            continue
        with torch.no_grad():
            got = model_logits(model, ids)
        # NaN where the model itself gives NaN (a row masked everywhere) counts as unchanged.
        same = (got == expected) | (got.isnan() & expected.isnan())
        diff = (got - expected).nan_to_num(nan=float("inf")).abs()[~same].max().item() if not same.all() else 0.0
        assert diff == 0.0, f"the model run on its own at length {T} changed by {diff:.3e} after a tree call"


def twin_of(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` (`treecompile.core.reference.model_copy`)."""
    from treecompile.core.reference import model_copy

    return model_copy(model)


def run(case: Case, model: nn.Module | None = None) -> list[dict]:
    """Builds the case, compiles it once, compares both trees; returns per-tree diffs.

    The rewritten graph runs as it is (``backend="eager"``): the passes are what the zoo
    tests, and lowering with AOTAutograd (tested on its own in test_compile_custom.py)
    would triple the compile time of every case.
    """
    from testing import ZOO_F64_TOLERANCE, hf_float64_casts

    from treecompile.compile.wrapper import tree_compile

    model = case.build() if model is None else model
    twin = twin_of(model)
    # A Hugging Face model computes its float32 casts in float64 here (both sides), so the bar
    # is float64 rounding, not the ~1e-7 those casts add.
    f64 = case.hf
    with hf_float64_casts(model, methods=True) if f64 else contextlib.nullcontext():
        compiled = tree_compile(model, backend="eager")
        diffs = []
        for _, batch, trees in batches():
            # The model run on its own after a tree call computes what it computed before (state
            # it keeps, e.g. a rotary cache, holds the unmodified model's values): checked after
            # the tree call, before the per-path reference runs the model.
            unchanged = functools.partial(assert_unchanged, model, twin, lengths=(batch.num_tokens, 7))
            diffs.append(compare(model, compiled, batch, trees, case.reference, after_tree=unchanged,
                                 rel=ZOO_F64_TOLERANCE if f64 else None))
    if case.attention is not None:
        assert dict(compiled.counters["rewrite_attention_pass"]) == case.attention, compiled.counters["rewrite_attention_pass"]
    return diffs
