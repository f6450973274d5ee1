"""rewrite_attention_pass: every causal attention becomes FlexAttention with the tree mask.

Each spelling of causal attention is matched once for all models; the three main ones:

* ``treecompile::causal_attention``: a Hugging Face attention-interface call (the wrapper
  routes HF's attention interface there, whatever kernel the model was configured with);
  it carries the call's scale, sliding window and soft-cap.
* ``scaled_dot_product_attention`` with ``is_causal=True``, or with an ``attn_mask`` that
  is structural (computed from no activation) and evaluates to the causal mask,
  optionally with a sliding window.
* manual softmax attention: ``softmax(scale * (q @ k^T) masked by a structural causal
  mask) @ v``, with scores by ``matmul``, ``bmm``, ``baddbmm`` or ``einsum``, casts and
  views in between, with or without a head dim.

A structural additive term that is linear in the key index per head is ALiBi: the kernel
adds ``slope * (positions[kv] - positions[q])``. A sink logit concatenated to the scores
(or HF's ``s_aux``) is one more term in each softmax denominator: the kernel output is
scaled by ``sigmoid(lse - sink)``.

Why the rewrite is exact: per-path training lets token ``q`` of a path attend to the
tokens before it on that path. In the packed row those are exactly the keys ``kv`` with
``kv <= q < subtree_end[kv]`` (the rows of ``q``'s ancestors' nodes and the earlier rows
of its own node), and the token at ``kv`` has the same key and value vectors as on the
path because everything before attention is computed from the path prefix alone
(by induction over layers). The softmax therefore runs over the same set of scores, so
the output row equals the per-path output row. Windows are measured in path positions
(``positions[q] - positions[kv]``), the distance per-path training sees, and soft-capping
acts on each score alone.

Before matching, `layout` moves scores laid out ``[seq_q, seq_k, ..]`` (a softmax over dim 1)
to ``[.., seq_q, seq_k]``. One module per spelling, each a row of `SPELLINGS` (what it matches, its rewrite, the counter
it adds to), all ending in one rewrite (`replace.replace`: the FlexAttention call with its scale,
window, soft-cap, ALiBi, sinks and the model's own mods): `hf_interface`, `sdpa`, `softmax` (the
manual spelling; its walk from the softmax back to the scores is the step table of `score_chain`,
its operands read by `operands`, a learned pair bias turned into a score_mod by `relative_bias`),
`mha` (``F.multi_head_attention_forward``), `flex` (a model's own FlexAttention), `pair_sum`
(attention without a softmax, ``(q @ k^T * D) @ v`` with a causal decay ``D``: its own kernel,
`treecompile.kernels.attention.pair_sum`) and `fft_conv` (a long convolution by FFT, a sum over
each token's ancestors: `treecompile.kernels.long_conv`); last, `dense_pairs` keeps scores that a model
works on beyond a mask and a softmax (CoPE's counted positions) as the model's own ``[S, S]`` ops,
with its masks and tables read at path positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from treecompile.passes._graph import SDPA, SOFTMAX, PassContext, is_call
from treecompile.passes.attention.dense_pairs import is_pair_exit, rewrite_dense_pairs
from treecompile.passes.attention.fft_conv import is_fft_conv, rewrite_fft_conv
from treecompile.passes.attention.flex import rewrite_flex
from treecompile.passes.attention.hf_interface import rewrite_hf_interface
from treecompile.passes.attention.layout import canonical_layout, sequence_channel_conv
from treecompile.passes.attention.mha import rewrite_multihead
from treecompile.passes.attention.mixing import rewrite_mixing
from treecompile.passes.attention.pair_sum import is_pair_product, rewrite_pair_sum
from treecompile.passes.attention.score_chain import spell_softmax
from treecompile.passes.attention.sdpa import rewrite_sdpa
from treecompile.passes.attention.softmax import rewrite_softmax_attention
from treecompile.passes.markers import is_marker

__all__ = ["SPELLINGS", "Spelling", "rewrite_attention_pass"]


@dataclass(frozen=True)
class Spelling:
    """One spelling of attention: ``matches(node)`` picks its nodes, ``rewrite(gm, ctx, node)``
    replaces a causal one with the tree kernel (adding 1 to ``counter``) or leaves it with a
    note for the verify pass to refuse; it returns False where the node, though matched, is
    another spelling's (the next one that matches sees it)."""

    counter: str
    matches: Callable[[fx.Node], bool]
    rewrite: Callable[[fx.GraphModule, PassContext, fx.Node], None]


def _is_flex(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr(torch.ops.higher_order, "flex_attention", None)


SPELLINGS: tuple[Spelling, ...] = (
    Spelling("hf_interface", lambda n: is_marker(n, "causal_attention"), rewrite_hf_interface),
    Spelling("sdpa", lambda n: is_call(n, SDPA), rewrite_sdpa),
    Spelling("softmax_attention", lambda n: is_call(n, SOFTMAX, ("softmax",)), rewrite_softmax_attention),
    Spelling("multihead_attention", lambda n: is_call(n, (torch.nn.functional.multi_head_attention_forward,)),
             rewrite_multihead),
    Spelling("flex_attention", _is_flex, rewrite_flex),
    # After the softmax spelling, whose output products it would otherwise see; a product whose
    # square operand reads no token or parameter is a fixed mixing matrix, not scores.
    Spelling("mixing", is_pair_product, rewrite_mixing),
    Spelling("pair_sum", is_pair_product, rewrite_pair_sum),
    Spelling("fft_conv", is_fft_conv, rewrite_fft_conv),
    # Last: what no kernel spelling took, computed on [S, S] tensors beyond a mask and a softmax.
    Spelling("dense_pairs", is_pair_exit, rewrite_dense_pairs),
)


def rewrite_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replaces causal attention calls with tree FlexAttention; counts them by kind.

    Counters (``ctx.counters["rewrite_attention_pass"]``): each spelling's (`SPELLINGS`), and
    ``flex_mods`` / ``relative_bias`` where a model's own mods or a pair bias ride along. Calls
    that are not provably causal are left in place with a note; the verify pass refuses them.
    """
    for node in list(gm.graph.nodes):
        spell_softmax(gm, node)
        canonical_layout(gm, ctx, node)
        sequence_channel_conv(gm, ctx, node)
    for node in list(gm.graph.nodes):
        for spelling in SPELLINGS:
            # A rewrite that returns False declines the node (not its kind): the next spelling sees it.
            if spelling.matches(node) and spelling.rewrite(gm, ctx, node) is not False:
                break
    return gm
