"""Tiny causal LMs written the way public repositories write them, for the architecture zoo.

Each class reproduces one repository's own spelling of attention, masks, positions, norms
and MLP (copied and cut down to tiny sizes: vocab 32, dim 32, 4 heads, 2 layers, a context
of 64), so that ``tree_compile`` meets the code people actually train, not a paraphrase of
it. The class docstring names the repository and file (and the commit where the file moved
on since), and says what was left out (KV caches, dropout, distributed code) or changed to
fit the zoo's calling convention: every model takes ``idx`` ``[B, T]`` (a LongTensor) and
returns logits ``[B, T, VOCAB]`` (or a tuple / an object whose first item / ``.logits`` are
the logits), over every position, never only the last one.

``CASES`` at the end states what ``tree_compile`` does with each model, as `tests/zoo.py`'s
own cases do: ``exact`` (loss, log-probabilities and every gradient equal per-path training),
or ``refused`` with a fragment of the refusal's first line. tests/test_zoo.py runs them with
the zoo's own cases, and docs/supported-models.md lists them.
"""

from __future__ import annotations

import torch
import zoo
from torch import nn
from zoo import perturb

from zoo_repos.alibi import AlibiFairseqLM
from zoo_repos.attention import (TransformerLensLM, 
    MHALM,
    DiffShiftLM,
    FinfoBiasBufferLM,
    GPT2TFPort,
    GptOssReference,
    LinspacePosLM,
    TorchExamplesTransformerLM,
)
from zoo_repos.common import HEADS, VOCAB
from zoo_repos.convs import H3LM, HyenaFFTLM, HyenaShortConvLM, RWKVShiftLM, S4DLM
from zoo_repos.gateloop import GateLoopLM
from zoo_repos.gla import GLALM
from zoo_repos.hawk import HawkLM
from zoo_repos.kerple import NeoXKerpleLM, kerple_params_above_eps
from zoo_repos.mamba_ssm import MambaLM
from zoo_repos.mambapy import MambaPyLM
from zoo_repos.titan_moe import TitanMoELM
from zoo_repos.mega import MegaLM
from zoo_repos.mixing import GMLPLM, MixerLM
from zoo_repos.pairs import CoPELM, MLSTMLM, ShawLM, StickBreakingLM
from zoo_repos.retention import RetNet
from zoo_repos.rnn import RNNModel
from zoo_repos.whisper import WhisperTextDecoder
from zoo_repos.gpt import (
    MinGPT,
    ModdedNanoGPT,
    ModdedNanoGPTFlex,
    NanoGPT,
    sdpa_reference,
)
from zoo_repos.labml import LabmlTransformerLM
from zoo_repos.litgpt import LitGPT
from zoo_repos.llama import Llama1Reference, MistralMoE, Rope2TLM, TitanLlama3
from zoo_repos.nanochat import NanoChat
from zoo_repos.positions import (CenteredPositionsLM, DecayFromStartLM, FairseqTransformerLM, PackedSeqlensLM,
                                 RobertaStyleLM)
from zoo_repos.qwen import QWen1LM
from zoo_repos.state import (CountingLM, FilledTableLM, Llama436DynamicNTKLM, Llama436LM, Llama436PositionIdsLM,
                              LucidrainsLegacyRotaryEmbedding, LucidrainsRotaryLM, PalmLM)
from zoo_repos.xtalking import XTalkingDecoder
from zoo_repos.xtransformers_olmo import OLMo, OlmoConfig, OlmoTrainerCall, XTransformerDecoder


def _build(cls, *args, **kw):
    def build():
        torch.manual_seed(0)
        return perturb(cls(*args, **kw).double().eval())

    return build


def check_causal(model: nn.Module, T: int = 12, seed: int = 0) -> float:
    """Largest change of the logits at positions ``< T - 3`` when the last 3 tokens change
    (0 for a causal model), and of the logits when nothing changes (0: deterministic)."""
    from treecompile.core.reference import logits_of

    g = torch.Generator().manual_seed(seed)
    a = torch.randint(2, VOCAB, (1, T), generator=g)
    b = a.clone()
    b[0, -3:] = (b[0, -3:] + 5) % VOCAB
    with torch.no_grad():
        la = logits_of(model(a))
        lb = logits_of(model(b))
    return (la[0, : T - 3] - lb[0, : T - 3]).abs().max().item()


_ROBERTA = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=80, pad_token_id=1, bos_token_id=0, eos_token_id=2, is_decoder=True)

CASES: list[zoo.Case] = [
    zoo.Case("nanogpt-flash", "karpathy/nanoGPT model.py: SDPA is_causal, learned wpe(arange), tied head, LayerNorm "
             "without bias", _build(NanoGPT, bias=False, flash=True)),
    zoo.Case("nanogpt-manual", "karpathy/nanoGPT model.py: manual attention, bias tril buffer [1,1,64,64] sliced "
             "[:,:,:T,:T] == 0 -> -inf", _build(NanoGPT, bias=True, flash=False)),
    zoo.Case("mingpt", "karpathy/minGPT mingpt/model.py: bias buffer masked_fill -inf, NewGELU, MLP via a lambda",
             _build(MinGPT)),
    zoo.Case("modded-nanogpt-sdpa", "KellerJordan/modded-nanogpt train_gpt2.py @607f2a38: rotary cached on the module "
             "(bf16), qk rms_norm, relu^2, value residual, U-net skips, SDPA is_causal, float32 logits",
             _build(ModdedNanoGPT)),
    zoo.Case("modded-nanogpt-flex", "modded-nanogpt 2024-12-04_ValueEmbed: flex_attention with a causal BlockMask "
             "from create_block_mask, value embeddings (the per-path reference computes the causal attention by SDPA: "
             "FlexAttention has no backward on CPU)", _build(ModdedNanoGPTFlex), reference=sdpa_reference,
             attention={"flex_attention": 2}),
    zoo.Case("qwen1-remote-code", "QwenLM/Qwen modeling_qwen.py: rotary [cos, sin] cached on the module over "
             "max(2 * T, 16) and cut [:, :T], logn query scaling cut [:, kl - ql : kl], bool tril buffer cut "
             "[:, :, kl - ql : kl, :kl] with torch.where(mask, w, finfo.min)", _build(QWen1LM)),
    zoo.Case("labml-transformer", "labmlai/annotated_deep_learning_paper_implementations transformers/mha.py: "
             "sequence-first, scores einsum('ibhd,jbhd->ijbh') scaled in place, subsequent_mask [i, j, 1, 1] "
             "masked_fill, nn.Softmax(dim=1), einsum('ijbh,jbhd->ibhd')", _build(LabmlTransformerLM),
             attention={"softmax_attention": 2, "layout": 2}),
    zoo.Case("labml-no-mask", "labml's MultiHeadAttention called without a mask (bidirectional)",
             _build(LabmlTransformerLM, causal=False), expect="refused",
             reason="softmax attention without a causal mask (bidirectional)"),
    zoo.Case("alibi-fairseq", "ofirpress/attention_with_linear_biases fairseq decoder: key-only ALiBi added to the "
             "triu(-inf) future mask cached on the module, cut [:bsz * heads, :T, :T], as the 3-D attn_mask of "
             "F.multi_head_attention_forward", _build(AlibiFairseqLM), attention={"multihead_attention": 2}),
    zoo.Case("nanochat", "karpathy/nanochat gpt.py with flash_attention.py's SDPA path: smear, value embeddings with "
             "gates, resid/x0 lambdas, bf16 rotary buffers cut [:, T0:T0 + T], QK rms_norm, sliding window as an "
             "arange mask on the short layer, padded vocabulary, float32 soft-capped logits", _build(NanoChat)),
    zoo.Case("litgpt", "Lightning-AI/litgpt model.py: fused qkv, GQA repeat_interleave, cos[:T] rope cache, SDPA "
             "is_causal, RMSNorm in float32", _build(LitGPT)),
    zoo.Case("litgpt-softcap", "litgpt with attention_logit_softcapping: manual scores, mask ones(T,T).triu(1) "
             "masked_fill_ in place with finfo.min", _build(LitGPT, attention_logit_softcapping=50.0)),
    zoo.Case("litgpt-sliding", "litgpt sliding window on layer 0: a Python loop over range(T) filling a full(-inf) "
             "mask row by row", _build(LitGPT, sliding_window_size=4, sliding_window_indices=[1, 0]), expect="refused",
             reason="the model makes the sequence length a constant"),
    zoo.Case("torchtitan-llama3", "pytorch/torchtitan llama3 model.py @177b295d2: complex freqs_cis[0:seqlen], "
             "view_as_complex, repeat_kv by expand, SDPA under sdpa_kernel, nn.RMSNorm", _build(TitanLlama3)),
    zoo.Case("x-transformers-xpos", "lucidrains/x-transformers: rotary (half the head dim) with xPos scale built from "
             "t.max(), einsum attention, masked_fill(ones(i, j).triu(j - i + 1), -finfo.max), float32 softmax",
             _build(XTransformerDecoder), expect="refused",
             reason="node 'max_1' (call_method max) at xtransformers_olmo.py"),
    zoo.Case("x-transformers-rotary", "x-transformers Decoder(rotary_pos_emb=True) without xPos: rotary of half the "
             "head dim (the unused t.max() still computed), einsum attention, triu(j - i + 1) mask",
             _build(XTransformerDecoder, rotary_xpos=False)),
    zoo.Case("x-transformers-talking-heads", "x-transformers Decoder(attn_talking_heads=True, residual_attn=True, "
             "gate_residual=True): 1 x 1 Conv2d over the heads before and after the softmax, each layer's scores plus "
             "the previous layer's (RealFormer), GRUCell residual gates; kept on dense [S, S] tensors",
             _build(XTalkingDecoder, depth=2), attention={"dense_pairs": 1}),
    zoo.Case("olmo", "allenai/OLMo olmo/model.py, called without a mask: RoPE cached in a dict, SwiGLU, SDPA "
             "is_causal, tied head", _build(OLMo)),
    zoo.Case("olmo-scale-logits", "OLMo with scale_logits: the logits scaled in place (logits.mul_) after the tied "
             "head", _build(OLMo, OlmoConfig(scale_logits=True))),
    zoo.Case("gpt-oss-reference", "openai/gpt-oss torch/model.py sdpa: token-major [n_tokens, kv_heads, q_mult, d] "
             "without a batch dim, K/V expanded over q_mult, einsum('qhmd,khmd->hmqk'), QK *= / += in place, a sink "
             "logit per head concatenated and dropped, sliding window on even layers",
             _build(GptOssReference), attention={"softmax_attention": 2}),
    zoo.Case("olmo-attention-bias", "OLMo as its trainer calls it (attention_mask of ones): triu(ones).masked_fill_"
             "(finfo.min) bias cached in a dict, + (1 - mask) * min, SDPA additive attn_mask",
             _build(OlmoTrainerCall)),
    zoo.Case("hyena-short-conv", "HazyResearch/safari Hyena operator without its long filter: Conv1d(padding=2, "
             "groups) on x.transpose(1, 2) sliced [..., :l], gated; then an SDPA layer", _build(HyenaShortConvLM)),
    zoo.Case("hyena-fft", "safari standalone_hyena.py HyenaOperator: implicit long filter z[:, :L] and fftconv "
             "(rfft(k, n=2L) / 2L, irfft(norm='forward')[..., :L]) as a sum over each token's ancestors",
             _build(HyenaFFTLM), attention={"fft_conv": 1}),
    zoo.Case("mega", "facebookresearch/mega moving_average_gated_attention.py: EMA kernel over arange(L) applied by "
             "fft conv, relative bias by the pad/tile Toeplitz trick (the key column of its own [T, T] built), "
             "triu(-inf) mask, addcmul update", _build(MegaLM), attention={"fft_conv": 1, "softmax_attention": 1,
                                                                             "relative_bias": 1}),
    zoo.Case("mega-untiled-bias", "MEGA's bias as a repeated vector times a column (not a function of i - j)",
             _build(MegaLM, bias="untiled"), expect="refused",
             reason="a bias over (query, key) pairs that is not built from the sequence index"),
    zoo.Case("mega-bias-from-start", "MEGA's Toeplitz bias over the vector's first 2T - 1 entries (its table "
             "changes with T)", _build(MegaLM, bias="from-start"), expect="refused",
             reason="a bias over (query, key) pairs that is not built from the sequence index"),
    zoo.Case("kerple-neox", "EleutherAI/gpt-neox ParallelKerpleLog shared by the layers: p.data / a.data clamped in "
             "every layer's call, tril(arange(k)[:, None].repeat(1, k) + arange(0, -k, -1)) cached on the module, "
             "-p * log(1 + a * diff) added to sequence-first baddbmm scores, tril(ones) < 0.5 masked_fill_",
             lambda: kerple_params_above_eps(_build(NeoXKerpleLM)()),
             attention={"softmax_attention": 2, "relative_bias": 2}),
    zoo.Case("kerple-neox-shrink", "the shared rpe writing p.data = p.data * 0.5 in each layer (not idempotent: the "
             "second layer reads another value)", _build(NeoXKerpleLM, shrink=True), expect="refused",
             reason="after the model began writing it in place"),
    zoo.Case("cope", "Golovneva et al. 2024 CoPE listing: gates = sigmoid(masked logits), positions by "
             "gates.flip(-1).cumsum(-1).flip(-1) clamped below T, position logits gathered at ceil / floor and "
             "interpolated, added in place to bmm scores with mask.log() of tril(ones)", _build(CoPELM),
             attention={"dense_pairs": 1}),
    zoo.Case("cope-mask-after", "CoPE with the causal mask added after the counted positions (they count future "
             "keys)", _build(CoPELM, mask_after=True), expect="refused", reason="it needs 0 there"),
    zoo.Case("cope-query-softmax", "CoPE with its softmax over the queries", _build(CoPELM, query_softmax=True),
             expect="refused", reason="runs over the queries, not the keys"),
    zoo.Case("stickbreaking", "shawntan/stickbreaking-attention sb_ref.py: logsigmoid logits masked by ones.triu(0), "
             "log(1 - beta) summed over the later keys by einsum('bhij,jk->bhik') with ones(T, T).tril(-1), "
             "exp weights and the remainder to the query's own value", _build(StickBreakingLM),
             attention={"dense_pairs": 1}),
    zoo.Case("stickbreaking-current", "stick-breaking attending to the current token (mask ones.triu(1))",
             _build(StickBreakingLM, attend_current=True), attention={"dense_pairs": 1}),
    zoo.Case("stickbreaking-mask-late", "stick-breaking with log(1 - beta) masked only after the sum over later keys",
             _build(StickBreakingLM, mask_late=True), expect="refused", reason="whose first is not 0 off the path"),
    zoo.Case("gmlp", "lucidrains/g-mlp-pytorch causal spatial gating unit: F.conv1d over the tokens as channels, "
             "weight[:n, :n] masked by triu_(1), bias[:n]", _build(GMLPLM), attention={"layout": 2, "dense_pairs": 2}),
    zoo.Case("gmlp-einsum", "gMLP with a [max_len, max_len] parameter: tril(W[:n, :n]) in einsum('b n d, m n -> "
             "b m d') plus a bias per position", _build(GMLPLM, unit="einsum"), attention={"dense_pairs": 2}),
    zoo.Case("gmlp-not-causal", "gMLP without its causal mask (every token reads the later ones)",
             _build(GMLPLM, causal=False), expect="refused", reason="it does not ignore off the path"),
    zoo.Case("synthesizer-dense", "Dense Synthesizer: w2(relu(w1(x)))[:, :n, :n] scores over the positions, "
             "triu(ones(n, n), 1) filled with -inf, bmm", _build(MixerLM, "dense"), attention={"dense_pairs": 2}),
    zoo.Case("synthesizer-dense-from-end", "the same scores cut from the end of the positions ([:, :, -n:])",
             _build(MixerLM, "dense-from-end"), expect="refused", reason="sequence length"),
    zoo.Case("synthesizer-random", "Random Synthesizer: a learned [1, max_len, max_len] score matrix cut [:, :n, :n], "
             "masked by -1e9, matmul", _build(MixerLM, "random"), attention={"dense_pairs": 2}),
    zoo.Case("mlp-mixer-causal", "MLP-Mixer token mixing made causal: F.linear(x.transpose(1, 2), "
             "W[:n, :n] * tril[:n, :n], b[:n]) over the sequence dim", _build(MixerLM, "mixer"),
             attention={"layout": 2, "dense_pairs": 2}),
    zoo.Case("l2-attention", "L2 self-attention (Kim et al. 2021): tied query/key weights, scores "
             "-cdist(q, q) ** 2 / sqrt(d)", _build(MixerLM, "l2"), attention={"dense_pairs": 2}),
    zoo.Case("shaw-relative", "lucidrains/conformer's Shaw relative positions made causal: rel_pos_emb(dist.clamp("
             "-m, m) + m) a [T, T, d] table in einsum('b h n d, n r d -> b h n r'), and relative values einsum('b h i "
             "j, i j d -> b h i d')", _build(ShawLM), attention={"dense_pairs": 1}),
    zoo.Case("shaw-over-length", "the same with the distances rescaled by the length (dist * m // n)",
             _build(ShawLM, over_length=True), expect="refused", reason="sequence length"),
    zoo.Case("xlstm-mlstm", "NX-AI/xlstm parallel_stabilized_simple: cumsum of log forget gates padded by a zero row, "
             "repeated to [T + 1, T + 1] minus its transpose, cut [..., 1:, 1:], where(tril, ., -inf) plus input "
             "gates, row-max stabilised, times the scores, normalised by max(|row sum|, exp(-max))", _build(MLSTMLM),
             attention={"dense_pairs": 1}),
    zoo.Case("xlstm-mlstm-global-max", "mLSTM stabilised by the maximum over the whole matrix (every query's keys)",
             _build(MLSTMLM, stabilize_rowwise=False), expect="refused",
             reason="takes an [S, S] tensor out of the region (view)"),
    zoo.Case("fla-gla-naive", "flash-linear-attention fla/layers/gla.py with fla/ops/gla/naive.py's "
             "naive_recurrent_gla (a loop over the tokens), low-rank gk_proj, logsigmoid / 16, gated RMSNorm",
             _build(GLALM, mode="naive")),
    zoo.Case("fla-gla-chunk", "the GLA layer calling chunk_gla(q, k, v, g=..., scale=None, ...) by fla's name",
             _build(GLALM, mode="chunk")),
    zoo.Case("fla-gla-gv", "fused_recurrent_gla with a decay on the values (gv)", _build(GLALM, mode="gv"),
             expect="refused", reason="gv (a decay per value channel) is not supported"),
    zoo.Case("recurrentgemma-hawk", "google-deepmind/recurrentgemma torch port: RG-LRU with BlockDiagonalLinear gates, "
             "SqrtBoundDerivative autograd.Function, reset = segment_pos == 0, rnn_scan's loop over the tokens "
             "(its Conv1D loop left out: nn.Conv1d), soft-capped tied logits", _build(HawkLM)),
    zoo.Case("gateloop", "lucidrains/gateloop-transformer: a complex data-controlled transition (torch.polar), "
             "kv = einsum(k, v) + 0.j scanned by the repository's associative_scan (JAX's ported: a recursion over "
             "elem[:, :-1:2] / elem[:, 1::2], cat and _interleave)", _build(GateLoopLM)),
    zoo.Case("gateloop-reversed", "the same scan run from the end (the elements flipped, scanned, flipped back)",
             _build(GateLoopLM, reverse=True), expect="refused", reason="flip"),
    zoo.Case("recurrentgemma-hawk-conv", "the same with the repository's Conv1D: a loop over the temporal shifts, "
             "windows x[:, :T - s] masked by ANDed slices of segment_pos != 0 at offsets 1..s, padded back in front",
             _build(HawkLM, repo_conv=True)),
    zoo.Case("mamba-ssm-ref", "state-spaces/mamba mamba_simple.py slow path: selective_scan_fn = selective_scan_ref "
             "(a Python loop over the tokens) with in-kernel dt bias, softplus, D skip and silu(z) gate, "
             "Conv1d(padding=3)[..., :L], in_proj.weight @ (b l) layouts", _build(MambaLM, version=1)),
    zoo.Case("mamba2-ssm-ref", "state-spaces/mamba mamba2.py slow path: mamba_chunk_scan_combined as its reference "
             "(length padded to a multiple of the chunk, ssd_minimal_discrete's segsum over chunks), grouped B / C, "
             "dt_bias and softplus in the kernel, z gated in the kernel", _build(MambaLM, version=2)),
    zoo.Case("mamba2-ssm-ref-dlimit", "mamba2.py with D per head dim (D_has_hdim) and a dt_limit clamp",
             _build(MambaLM, version=2, D_has_hdim=True, dt_limit=(0.01, 0.2))),
    zoo.Case("mamba2-ssm-init-states", "mamba2_simple.py's learnable initial states [heads, headdim, state] repeated "
             "over the batch into mamba_chunk_scan_combined", _build(MambaLM, version=2, learnable_init_states=True)),
    zoo.Case("s4d", "state-spaces/s4 s4d.py + example.py: Vandermonde kernel over arange(L) from a complex diagonal "
             "A, fft conv over n = 2L sliced [..., :L], D skip, Conv1d + GLU output", _build(S4DLM),
             attention={"fft_conv": 1}),
    zoo.Case("h3", "HazyResearch/H3 h3.py: shift-SSM kernel irfft(rfft(B) * rfft(C))[:N] padded to L, diagonal-SSM "
             "kernel, two fft convs of size L_kernel + L, q * (k * v) gating", _build(H3LM), attention={"fft_conv": 2}),
    zoo.Case("roberta-causal-lm", "transformers RobertaForCausalLM (is_decoder): positions cumsum(input_ids != pad) "
             "+ padding_idx, pad id 1 occurring in the trees", zoo._hf("RobertaConfig", "RobertaForCausalLM",
                                                                       common=False, **_ROBERTA), hf=True),
    zoo.Case("roberta-style-positions", "hand-written decoder with RoBERTa's create_position_ids_from_input_ids "
             "(cumsum of non-pad + padding_idx)", _build(RobertaStyleLM)),
    zoo.Case("fairseq-transformer-lm", "facebookresearch/fairseq TransformerDecoder: make_positions sinusoids, "
             "buffered_future_mask cached on the module (fill_ -inf, triu), F.multi_head_attention_forward",
             _build(FairseqTransformerLM)),
    zoo.Case("rwkv5-decay-from-start", "BlinkDL RWKV-v5 matrix form: a learned initial state decayed by "
             "w.repeat(1, T).pow(arange(T - 1, -1, -1)) flipped along time, (r @ s) * wb",
             _build(DecayFromStartLM)),
    zoo.Case("rwkv5-decay-to-end", "the same table unflipped: w ** (T - 1 - t), the decay to the end of the sequence",
             _build(DecayFromStartLM, from_end=True), expect="refused",
             reason="whose entries change with the sequence length"),
    zoo.Case("xpos-centred-positions", "torchscale XPOS's centred positions arange(-T // 2, T - T // 2) in a "
             "sinusoid added to the embeddings", _build(CenteredPositionsLM), expect="refused",
             reason="whose entries change with the sequence length"),
    zoo.Case("transformerlens", "TransformerLens: einsum('bqhd,bkhd->bhqk') scores, where(mask[:q, :k], scores, "
             "IGNORE) with tril and -inf buffers, where(isnan(pattern), 0, pattern), the values first in "
             "einsum('bkhd,bhqk->bqhd', v, pattern), "
             "W_pos[:T]", _build(TransformerLensLM), attention={"softmax_attention": 1}),
    zoo.Case("torchtitan-moe-sorted", "pytorch/torchtitan moe.py without its tokens_per_expert counter: argsort(stable) of "
             "the expert indices, histc counts as split sizes, gather / cat / vstack / scatter_add",
             _build(TitanMoELM, count_tokens=False)),
    zoo.Case("torchtitan-moe", "pytorch/torchtitan moe.py: as torchtitan-moe-sorted, with tokens_per_expert.add_(histc) in "
             "every forward", _build(TitanMoELM)),
    zoo.Case("mambapy-pscan", "alxndrTL/mamba.py: pscan = PScan.apply, a Blelloch scan written in place on views "
             "of a power-of-two padded copy, with its own backward; conv1d(..)[:, :, :L]", _build(MambaPyLM)),
    zoo.Case("whisper-decoder", "openai/whisper: scaled_dot_product_attention imported by name at module level, "
             "is_causal=mask is not None and n_ctx > 1, positional_embedding[offset : offset + T]",
             _build(WhisperTextDecoder)),
    zoo.Case("mistral-inference-seqlens", "mistralai/mistral-inference: positions cat([arange(0, seqlen) for seqlen "
             "in seqlens]) over the packed batch gathering a learned table; SDPA in xformers' (1, S, H, D) layout, "
             "its output's transpose viewed as [S, H * D]", _build(PackedSeqlensLM)),
    zoo.Case("mistral-moe", "mistralai/mistral-src moe_one_file_ref.py: torch.where(selected_experts == i), "
             "results[batch_idx] +=, freqs_cis[positions], mask log(tril(ones))", _build(MistralMoE)),
    zoo.Case("mixtral-index-add", "transformers' pre-fusion Mixtral dispatch: zeros((B * S, H)), one_hot expert "
             "mask, torch.where, hidden_states[None, top_x], index_add_; SDPA attention",
             _build(MistralMoE, index_add=True)),
    zoo.Case("mha-no-mask", "nn.MultiheadAttention(h, h, h) without a mask in layer 0 (bidirectional), SDPA causal "
             "in layer 1", _build(MHALM, causal=False), expect="refused",
             reason="nn.MultiheadAttention without a causal mask (bidirectional"),
    zoo.Case("mha-causal-mask", "nn.MultiheadAttention with attn_mask=nn.Transformer.generate_square_subsequent_mask"
             "(T), is_causal=True", _build(MHALM, causal=True)),
    zoo.Case("torch-examples-transformer", "pytorch/examples word_language_model TransformerModel: nn.Transformer "
             "encoder, float mask (triu(ones) == 1).transpose cached in self.src_mask, sequence-first",
             _build(TorchExamplesTransformerLM)),
    zoo.Case("word-language-model-lstm", "pytorch/examples word_language_model RNNModel('LSTM'): nn.LSTM of 2 "
             "layers over the sequence-first input from init_hidden's zeros, decoder tied to the embedding, "
             "log_softmax", _build(RNNModel, "LSTM")),
    zoo.Case("word-language-model-gru", "word_language_model RNNModel('GRU')", _build(RNNModel, "GRU", tie_weights=False)),
    zoo.Case("word-language-model-rnn-relu", "word_language_model RNNModel('RNN_RELU'), one layer",
             _build(RNNModel, "RNN_RELU", nlayers=1)),
    zoo.Case("bidirectional-lstm", "RNNModel with nn.LSTM(bidirectional=True)", _build(RNNModel, bidirectional=True),
             expect="refused", reason="is a recurrent layer that is bidirectional"),
    zoo.Case("lstm-final-state", "RNNModel whose LSTM's final h of the last layer is added to every position",
             _build(RNNModel, read_final=True), expect="refused", reason="whose final state is read"),
    zoo.Case("diff-shift", "h + torch.diff(h, dim=1, prepend=zeros) after attention (each row minus the previous "
             "row: minus the parent's last row at a node's first token)", _build(DiffShiftLM)),
    zoo.Case("retnet-jamie-stirling", "Jamie-Stirling/RetNet: parallel retention per head in a Python loop, "
             "(Q @ K.permute(0, 2, 1)) * D with D = gamma ** (n - m) * (n >= m) and D[D != D] = 0 in place, xPos, "
             "GroupNorm, swish gate", _build(RetNet), attention={"pair_sum": HEADS}),
    zoo.Case("rwkv-token-shift", "BlinkDL/RWKV-LM v4neo RWKV_ChannelMix: token shift nn.ZeroPad2d((0, 0, 1, -1)) "
             "as the feed-forward (the previous token on the path), SDPA attention", _build(RWKVShiftLM)),
    zoo.Case("llama1-reference", "meta-llama/llama model.py: freqs_cis for max_seq_len * 2 as a plain attribute, "
             "re-assigned in forward, sliced [start_pos : start_pos + seqlen]; triu(full(-inf), 1) additive",
             _build(Llama1Reference)),
    zoo.Case("rope-2t-sliced", "RoPE table precompute_freqs_cis(hd, 2 * T) built per call and sliced [0:T]",
             _build(Rope2TLM)),
    zoo.Case("linspace-positions", "sinusoidal positions at torch.linspace(0, T - 1, T)", _build(LinspacePosLM)),
    zoo.Case("finfo-min-bias-buffer", "additive 0 / finfo(float32).min causal bias buffer sliced [:, :, :T, :T]",
             _build(FinfoBiasBufferLM)),
    zoo.Case("gpt2-tf-port", "openai/gpt-2 src/model.py ported: mask as arithmetic w * b - 1e10 * (1 - b), "
             "hand-written softmax/norm/gelu, wte[X] + wpe[positions] by indexing", _build(GPT2TFPort)),
    # ------------------------------------------------------------------ state kept between calls
    zoo.Case("llama-4.36-rope-cache", "transformers 4.36 LlamaRotaryEmbedding: cos/sin cached for 16 positions, "
             "registered again longer when a sequence is longer (the tree's rows are), cos[position_ids]",
             _build(Llama436LM)),
    zoo.Case("llama-4.36-dynamic-ntk", "transformers 4.36 LlamaDynamicNTKScalingRotaryEmbedding: a sequence longer "
             "than 16 positions rebuilds the tables with a base scaled by its length", _build(Llama436DynamicNTKLM),
             expect="refused", reason="uses the sequence length as a value"),
    zoo.Case("llama-4.36-position-ids", "transformers 4.36 LlamaModel given position_ids (the tree's positions, as "
             "[1, S]): cos_cached[:seq_len] gathered at position_ids.view(-1, seq_length)", _build(Llama436PositionIdsLM)),
    zoo.Case("rotary-embedding-torch-cache", "lucidrains/rotary-embedding-torch: freqs written in place into the "
             "cached_freqs buffer (length in a Python int), read back by the next, shorter call",
             _build(LucidrainsRotaryLM)),
    zoo.Case("rotary-embedding-torch-0.2", "rotary-embedding-torch 0.2: cached_freqs registered as a None buffer "
             "beside a dummy buffer, registered again in forward (tmp_store; Dynamo hands the graph a buffer after "
             "its own inputs)", _build(LucidrainsRotaryLM, LucidrainsLegacyRotaryEmbedding)),
    zoo.Case("table-filled-in-place", "a sinusoid table buffer filled in place up to the longest length seen and "
             "read back in the same call (self.table[:T] = ...; x + self.table[:T])", _build(FilledTableLM)),
    zoo.Case("palm-lazy-buffers", "lucidrains/PaLM-pytorch: causal mask and rotary table registered as buffers at the "
             "length of the call, sliced [:n] by later calls; multi-query einsum", _build(PalmLM)),
    zoo.Case("step-counters", "self.steps += 1 on a tensor buffer and self.num_calls += 1 on a Python int at "
             "every call", _build(CountingLM)),
]

BY_ID = {c.id: c for c in CASES}
