"""The kernels a model's layers call by name that treecompile swaps, for one call, for its drop-ins.

`SEQUENCE_KERNELS` maps a function's name to the leading parameters a function of that name must
take to be swapped and its drop-in (`treecompile.capture.drop_ins` for Hugging Face's and
flash-linear-attention's Gated DeltaNet, `treecompile.capture.library_drop_ins` for mamba-ssm's,
flash-linear-attention's GLA and recurrentgemma's); `treecompile.capture.dynamo.sequence_kernels`
finds them in a model, `swapped_kernels` swaps them for a call.
"""

from __future__ import annotations

from treecompile.capture.drop_ins import (
    fla_chunk_gated_delta_rule,
    hf_causal_conv1d_fn,
    hf_chunk_gated_delta_rule,
    hf_mamba2_chunk_scan,
    hf_mamba2_split_conv1d_scan_combined,
    hf_mamba_inner_fn,
    hf_mamba_selective_scan,
)
from treecompile.capture.library_drop_ins import (
    CHUNK_SCAN_PARAMS,
    SELECTIVE_SCAN_PARAMS,
    associative_scan_for,
    fla_chunk_gla,
    fla_fused_recurrent_gla,
    fla_naive_recurrent_gla,
    hf_rwkv_linear_attention,
    mamba_chunk_scan_combined,
    parallel_scan_for,
    recurrentgemma_rnn_scan,
    selective_scan_fn,
)

__all__ = ["SEQUENCE_KERNELS"]

_RWKV_PARAMS = ("time_decay", "time_first", "key", "value", "state", "return_state")

#: Module-level sequence kernels of hybrid models (Hugging Face's, behind
#: ``use_kernel_func_from_hub_with_fallback``, flash-linear-attention's and mamba-ssm's), by name: the
#: leading parameters a function of that name must take to be swapped, and its drop-in,
#: which calls a treecompile custom op with the same linear-sequence semantics (one node
#: per layer for the passes to find). A drop-in marked ``per_original`` is built for the function
#: it replaces, or None where that function is not what its name says.
SEQUENCE_KERNELS = {
    "torch_chunk_gated_delta_rule": (("query", "key", "value", "g", "beta"), hf_chunk_gated_delta_rule),
    "torch_recurrent_gated_delta_rule": (("query", "key", "value", "g", "beta"), hf_chunk_gated_delta_rule),
    "chunk_gated_delta_rule": (("q", "k", "v", "g", "beta"), fla_chunk_gated_delta_rule),
    "fused_recurrent_gated_delta_rule": (("q", "k", "v", "g", "beta"), fla_chunk_gated_delta_rule),
    "chunk_gla": (("q", "k", "v", "g", "scale"), fla_chunk_gla),
    "fused_chunk_gla": (("q", "k", "v", "g", "scale"), fla_chunk_gla),
    "fused_recurrent_gla": (("q", "k", "v", "gk", "gv", "scale"), fla_fused_recurrent_gla),
    "naive_recurrent_gla": (("q", "k", "v", "gk", "initial_state", "output_final_state"), fla_naive_recurrent_gla),
    "rnn_scan": (("x", "a", "reset", "h0", "acc_dtype"), recurrentgemma_rnn_scan),
    "chunk_kimi_delta_attention": (("query", "key", "value", "g", "beta"), hf_chunk_gated_delta_rule),
    "recurrent_kimi_delta_attention": (("query", "key", "value", "g", "beta"), hf_chunk_gated_delta_rule),
    "causal_conv1d_fn": (("hidden_states", "weight", "bias", "activation"), hf_causal_conv1d_fn),
    "mamba2_chunk_scan": (("hidden_states", "dt", "A", "B", "C"), hf_mamba2_chunk_scan),
    "mamba2_split_conv1d_scan_combined": (("zxbcdt", "conv1d_weight"), hf_mamba2_split_conv1d_scan_combined),
    "mamba_selective_scan": (("hidden_states", "dt", "A", "B", "C"), hf_mamba_selective_scan),
    "mamba_inner_fn": (("xz", "conv1d_weight"), hf_mamba_inner_fn),
    # mamba-ssm's own (custom models on mamba_ssm.modules, or copying its reference listings)
    "selective_scan_fn": (SELECTIVE_SCAN_PARAMS, selective_scan_fn),
    "selective_scan_ref": (SELECTIVE_SCAN_PARAMS, selective_scan_fn),
    "mamba_chunk_scan_combined": (CHUNK_SCAN_PARAMS, mamba_chunk_scan_combined),
    "rwkv_linear_attention": (_RWKV_PARAMS, hf_rwkv_linear_attention),
    "rwkv_linear_attention_cpu": (_RWKV_PARAMS, hf_rwkv_linear_attention),
    # JAX's lax.associative_scan ported by hand (S5, GateLoop)
    "associative_scan": ((), associative_scan_for),  # any signature: associative_scan_for runs it first
    # alxndrTL/mamba.py's Blelloch scan (pscan = PScan.apply), likewise run first
    "pscan": ((), parallel_scan_for),
}
