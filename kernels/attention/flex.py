"""Tree attention through FlexAttention's higher-order op, and its BlockMask builders.

The rewritten graph calls :func:`tree_attention_fn` products, which call
``torch._higher_order_ops.flex_attention`` directly rather than the public
``flex_attention``: on CPU the public function has no backward
(``NotImplementedError: FlexAttention does not support backward on CPU``), while the
higher-order op runs forward and backward eagerly and under AOTAutograd. In float64 the
eager op matched SDPA on the dense tree mask to 3e-16 in output and in dq, dk, dv
(S=150, a 3-node tree). The op's argument tuple changes between torch versions; all
knowledge of it lives in :class:`BlockLayout` and :func:`call_flex_hop`.

The tree rule is evaluated by a ``mask_mod`` that reads the tree tensors as *mask
buffers* (extra arguments), not as closure constants, so one traced graph serves every
batch. Nothing here builds an ``[S, S]`` mask (the dense reference is
``TreeBatch.reference_attention_mask``, for tests).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask

from treecompile.kernels.attention import cpu_attention  # noqa: F401  (registers treecompile::tree_attention_cpu)

from treecompile.kernels.attention.blockmask import tree_block_mask
from treecompile.kernels.attention.flex_mods import user_mods
from treecompile.kernels.attention.flex_options import MASK_BLOCK, flex_kernel_options
from treecompile.kernels.attention.masks import MASK_KINDS, tree_mask_mod

__all__ = [
    "BLOCK_SIZE",
    "BlockLayout",
    "BlockTensors",
    "AttentionSpec",
    "softcap_score_mod",
    "alibi_score_mod",
    "interval_block_mask",
    "demote_full_blocks",
    "split_block_mask",
    "call_flex_hop",
    "call_kernel_options",
    "main_kernel_option",
    "tree_attention_fn",
]

#: Rows per BlockMask block (FlexAttention's default tile; every kernel tile in
#: `treecompile.kernels.attention.flex_options` divides it).
BLOCK_SIZE = MASK_BLOCK

# --------------------------------------------------------------------------- score_mods


def softcap_score_mod(cap: float | None) -> Callable:
    """``score_mod`` for logit soft-capping, ``cap * tanh(score / cap)`` (Gemma 2).

    Soft-capping acts on each score alone, so it is the same on a tree as on a path.
    """
    if cap is None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score

        score_mod.__name__ = "identity_score"
        return score_mod

    def capped(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    capped.__name__ = f"softcap_score_{cap:g}".replace(".", "p")
    return capped


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                values: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with a sink logit per query: ``(sum_j e^s_j v_j + e^sink value) / (sum_j e^s_j
    + e^sink)`` (``value`` 0 without ``values``).

    That is the attention output times ``w = sum_j e^s_j / (sum_j e^s_j + e^sink)``, i.e.
    ``sigmoid(lse - sink)``, plus ``(1 - w) value``; the gradient reaches the scores through
    ``lse``. ``values`` ``[1, Hq, S or 1, Dv]``: a key appended with its own value
    (``nn.MultiheadAttention``'s ``bias_k`` / ``bias_v``).
    """
    w = torch.sigmoid(lse - sinks.to(lse.dtype)).unsqueeze(-1)
    if values is None:
        return out * w.to(out.dtype)
    return out * w.to(out.dtype) + values.to(out.dtype) * (1 - w).to(out.dtype)


def alibi_score_mod(inner: Callable) -> Callable:
    """``score_mod(score, b, h, q, kv, slopes, positions)``: ``inner``, then the ALiBi bias
    ``slopes[h] * (positions[kv] - positions[q])`` in path positions."""

    def alibi(score, b, h, q_idx, kv_idx, slopes, positions):
        rel = (positions[kv_idx] - positions[q_idx]).to(score.dtype)
        return inner(score, b, h, q_idx, kv_idx) + slopes[h].to(score.dtype) * rel

    alibi.__name__ = f"alibi_{inner.__name__}"
    return alibi


# --------------------------------------------------------------------------- BlockMasks


def interval_block_mask(subtree_end: torch.Tensor, block_size: int = BLOCK_SIZE, *, min_blocks: int = 1) -> BlockMask:
    """The BlockMask of the interval rule, from per-block min/max of ``subtree_end``.

    See `treecompile.kernels.attention.blockmask.tree_block_mask`: no pair is evaluated, and the result
    equals ``create_block_mask``'s (with ``min_blocks``, at least that many blocks each side, the
    ones past the rows empty).
    """
    return tree_block_mask(subtree_end, block_size=block_size, min_blocks=min_blocks)


# --------------------------------------------------------------------------- version shim


class BlockTensors(NamedTuple):
    """The block tables of a ``BlockMask``: the tensors a rewritten graph takes as inputs.

    Counts are ``[1, 1, nb]`` and index lists ``[1, 1, nb, nb]`` int32 (batch 1, shared by
    all heads); ``full_*`` blocks skip the ``mask_mod``.
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor

    @classmethod
    def of(cls, block_mask: BlockMask) -> BlockTensors:
        """The tables of ``block_mask``, read by name.

        Raises:
            RuntimeError: a table is missing (a ``BlockMask`` built without full blocks).
        """
        tables = cls(*(getattr(block_mask, name) for name in cls._fields))
        missing = [name for name, t in zip(cls._fields, tables) if not isinstance(t, torch.Tensor)]
        if missing:
            raise RuntimeError(f"BlockMask has no {', '.join(missing)}; build it with tree_block_mask")
        return tables


@dataclass(frozen=True)
class BlockLayout:
    """Where the items of ``BlockMask.as_tuple()`` sit, so the tuple can be rebuilt in-graph.

    ``slots[i]`` is ``("tensor", name)`` for the :class:`BlockTensors` field ``name``,
    ``("q_len",)``/``("kv_len",)`` for the sequence lengths, ``("const", value)`` for
    anything else, and ``("mask_mod",)`` for the mask function. This is the one place that
    knows the tuple's layout, which differs between torch versions (2.13 added
    ``dq_write_order`` entries).
    """

    slots: tuple[tuple, ...]


def split_block_mask(block_mask: BlockMask) -> tuple[BlockTensors, BlockLayout]:
    """Splits a BlockMask into its tables (graph inputs) and a static :class:`BlockLayout`.

    Raises:
        RuntimeError: ``as_tuple()`` holds a tensor that is not one of the :class:`BlockTensors`.
    """
    tables = BlockTensors.of(block_mask)
    items = block_mask.as_tuple()
    slots: list[tuple] = []
    for pos, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            name = next((n for n, t in zip(BlockTensors._fields, tables) if t is item), None)
            if name is None:
                raise RuntimeError(f"BlockMask.as_tuple() holds an unknown tensor at position {pos}")
            slots.append(("tensor", name))
        elif pos == 0:
            slots.append(("q_len",))
        elif pos == 1:
            slots.append(("kv_len",))
        elif pos == len(items) - 1 and callable(item):
            slots.append(("mask_mod",))
        else:
            slots.append(("const", item))
    return tables, BlockLayout(tuple(slots))


def _block_size(layout: BlockLayout) -> int:
    """The query block size recorded in a layout (the first integer constant after the tensors)."""
    seen_tensor = False
    for slot in layout.slots:
        if slot[0] == "tensor":
            seen_tensor = True
        elif seen_tensor and slot[0] == "const" and isinstance(slot[1], int):
            return slot[1]
    raise RuntimeError(f"no block size in BlockMask layout {layout.slots}")


def _block_tuple(layout: BlockLayout, tables: BlockTensors, q_len, kv_len, mask_mod: Callable) -> tuple:
    out = []
    for slot in layout.slots:
        kind = slot[0]
        if kind == "tensor":
            out.append(getattr(tables, slot[1]))
        elif kind == "q_len":
            out.append(q_len)
        elif kind == "kv_len":
            out.append(kv_len)
        elif kind == "mask_mod":
            out.append(mask_mod)
        else:
            out.append(slot[1])
    return tuple(out)


def call_kernel_options(q) -> dict | None:
    """The ``kernel_options`` our FlexAttention calls ask for: on CUDA, FlexAttention's main
    Triton kernel (:func:`main_kernel_option`) with the tiles of the options table
    (kernels/attention/flex_options.py); elsewhere the table's (``None``: torch's own choice)."""
    table = flex_kernel_options(q)
    if q.device.type != "cuda":
        return table or None
    return {**main_kernel_option(), **table}


@functools.cache
def main_kernel_option() -> dict:
    """The option that keeps FlexAttention on its main Triton kernel.

    Left to choose (``"AUTO"``), Inductor takes its decoding kernel for fewer than 128 query
    rows. That kernel sizes its query tile as rows x query heads per key head, rounded up to a
    power of two, and drops every configuration whose tile does not divide the block mask's
    128 rows: where rows x heads per key head exceed 128 (65 to 127 rows at two query heads
    per key head) none is left, and the compile fails (``NoValidChoicesError``; torch 2.11,
    seen on an H200 for a streamed part's ``[prefix ; own]`` attention). A streamed part, a
    CP rank's rows or a small tree can have so few rows, and training wants the kernel with a
    backward anyway."""
    import typing

    from torch.nn.attention import flex_attention as fa

    if "TRITON" in typing.get_args(getattr(fa, "_Backend", None)):
        return {"BACKEND": "TRITON"}
    return {"FORCE_USE_FLEX_ATTENTION": True}  # torch without the BACKEND selector


@functools.cache
def _kernel_options_fn() -> Callable:
    from torch.nn.attention import flex_attention as fa

    apply = fa._apply_kernel_options
    params = inspect.signature(apply).parameters

    def options(q, k, v):
        kwargs = {"return_aux": None} if "return_aux" in params else {}
        # The log-sum-exp is kept for the backward pass.
        return dict(apply(q, k, v, True, call_kernel_options(q), **kwargs))

    return options


def call_flex_hop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Callable,
    mask_mod: Callable,
    block_tensors: BlockTensors,
    layout: BlockLayout,
    mask_buffers: Sequence[torch.Tensor],
    scale: float,
    score_buffers: Sequence[torch.Tensor] = (),
    return_lse: bool = False,
):
    """Calls ``torch._higher_order_ops.flex_attention`` and returns the output ``[B, Hq, S, Dv]``.

    Args:
        q: ``[B, Hq, S, D]``; k: ``[B, Hkv, S, D]``; v: ``[B, Hkv, S, Dv]`` (``Hq % Hkv == 0``:
            the op broadcasts key/value heads for GQA/MQA).
        score_mod: ``score_mod(score, b, h, q, kv)``.
        mask_mod: ``mask_mod(b, h, q, kv, *mask_buffers)``.
        block_tensors, layout: from :func:`split_block_mask`.
        mask_buffers: tensors the mask_mod reads.
        scale: multiplies ``q @ k^T`` before ``score_mod``.
        score_buffers: tensors the score_mod reads.
        return_lse: also return the natural log-sum-exp ``[B, Hq, S]`` (the op's is base 2).
    """
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    block = _block_tuple(layout, block_tensors, q.shape[-2], k.shape[-2], mask_mod)
    options = _kernel_options_fn()(q, k, v)
    out, lse, _max = flex_hop(q, k, v, score_mod, block, float(scale), options, tuple(score_buffers),
                              tuple(mask_buffers))
    if not return_lse:
        return out
    if options.get("BACKEND") != "FLASH":
        lse = lse * math.log(2.0)
    return out, lse


def _merge_block_lists(num, idx, full_num, full_idx):
    """One block list holding the partial and the full blocks of each row, in increasing order."""
    n = idx.shape[-1]
    cols = torch.arange(n, device=idx.device)
    # Entries past a row's count sort after every real block index (which is < n).
    key_p = torch.where(cols < num[..., None], idx.to(torch.int64), n + cols)
    key_f = torch.where(cols < full_num[..., None], full_idx.to(torch.int64), 2 * n + cols)
    merged = torch.cat([key_p, key_f], dim=-1).sort(dim=-1).values[..., :n]
    return (num + full_num).to(num.dtype), merged.clamp(max=n - 1).to(idx.dtype)


def demote_full_blocks(tables: BlockTensors) -> BlockTensors:
    """The same block tables with every full block made partial.

    A full block skips the ``mask_mod``: right for the tree rule, wrong once a sliding
    window cuts through the block. Windowed layers therefore evaluate the mask in every
    live block.
    """
    kv_num, kv_idx = _merge_block_lists(tables.kv_num_blocks, tables.kv_indices, tables.full_kv_num_blocks,
                                        tables.full_kv_indices)
    q_num, q_idx = _merge_block_lists(tables.q_num_blocks, tables.q_indices, tables.full_q_num_blocks,
                                      tables.full_q_indices)
    return tables._replace(kv_num_blocks=kv_num, kv_indices=kv_idx,
                           full_kv_num_blocks=torch.zeros_like(tables.full_kv_num_blocks),
                           q_num_blocks=q_num, q_indices=q_idx,
                           full_q_num_blocks=torch.zeros_like(tables.full_q_num_blocks))


# --------------------------------------------------------------------------- graph entry point


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of one tree attention call site (hashable: call sites share kernels).

    Attributes:
        kind: a key of :data:`MASK_KINDS`.
        scale: multiplies ``q @ k^T``; None means ``1/sqrt(head_dim)``.
        window: sliding window in path positions, or None.
        softcap: logit soft-capping value, or None.
        chunks: ``path_bits.shape[1]`` for the bitmask rule.
        layout: the BlockMask tuple layout.
        alibi: per query head, an ALiBi slope: ``slope * (positions[kv] - positions[q])`` is
            added to each score (path positions, the bias per-path training adds); None for none.
        sinks: the call passes ``sinks=`` logits ``[1, Hq, S]`` (or broadcastable): one more
            logit per query in the softmax denominator, with no value (gpt-oss attention
            sinks); the output is scaled by ``sigmoid(lse - sink)``.
        mods: the key of a model's own FlexAttention ``score_mod`` / ``mask_mod``
            (`treecompile.kernels.attention.flex_mods`), run on the rows' path positions, the mask ANDed
            with the tree rule; the call passes the tensors they read as ``mod_buffers=``.
    """

    kind: str
    scale: float | None
    window: int | None
    softcap: float | None
    chunks: int
    layout: BlockLayout
    alibi: tuple[float, ...] | None = None
    sinks: bool = False
    mods: str | None = None


def _common_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in the dtype the attention computes in: the autocast dtype when autocast is on
    (as scaled_dot_product_attention, which this call replaces, casts them), else their
    common promoted dtype."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _with_user_mods(spec: AttentionSpec, mask_mod: Callable, score_mod: Callable, n_rule: int
                    ) -> tuple[Callable, Callable]:
    """The tree's ``mask_mod`` ANDed with the model's own, and the model's ``score_mod``, both
    reading ``positions`` and the model's tensors after the tree's buffers (see `flex_mods`)."""
    mods = user_mods(spec.mods)

    def mask(b, h, q_idx, kv_idx, *buffers):
        rule, positions, extra = buffers[:n_rule], buffers[n_rule], buffers[n_rule + 1:]
        # A sliding window's tree rule reads the positions after its own tensors.
        ok = mask_mod(b, h, q_idx, kv_idx, *rule, *((positions,) if spec.window is not None else ()))
        if mods.mask is None:
            return ok
        _, mask_bufs = mods.split(extra)
        return ok & mods.mask(b, h, positions[q_idx], positions[kv_idx], *mask_bufs)

    def score(s, b, h, q_idx, kv_idx, positions, *extra):
        s = score_mod(s, b, h, q_idx, kv_idx)
        if mods.score is None:
            return s
        score_bufs, _ = mods.split(extra)
        return mods.score(s, b, h, positions[q_idx], positions[kv_idx], *score_bufs)

    mask.__name__, score.__name__ = f"{mask_mod.__name__}_and_{mods.name}", mods.name
    return mask, score


def _flex_hop_attention(spec: AttentionSpec, mask_mod: Callable, score_mod: Callable, q, k, v, positions,
                        buffers: tuple[torch.Tensor, ...], tables: BlockTensors, scale: float,
                        mod_buffers: tuple[torch.Tensor, ...] = ()):
    """``(out, lse)`` of one tree attention call through FlexAttention's higher-order op.

    The ``mask_mod`` reads the rule's tensors, then ``positions`` under a sliding window; the
    ALiBi ``score_mod`` reads the slopes and ``positions``; a model's own mods read
    ``positions`` and ``mod_buffers``.
    """
    mask_buffers = (*buffers, positions) if spec.window is not None else buffers
    score_buffers = ()
    if spec.alibi:
        slopes = torch.tensor(spec.alibi, dtype=torch.float32, device=q.device)
        score_buffers = (slopes, positions)
    if spec.mods:
        if spec.alibi:  # the attention pass never pairs them: say so rather than drop the bias
            raise NotImplementedError("ALiBi together with a model's own score_mod / mask_mod")
        mask_mod, score_mod = _with_user_mods(spec, mask_mod, score_mod, len(buffers))
        mask_buffers = (*buffers, positions, *mod_buffers)
        score_buffers = (positions, *mod_buffers)
    return call_flex_hop(
        q,
        k,
        v,
        score_mod=alibi_score_mod(score_mod) if spec.alibi and not spec.mods else score_mod,
        mask_mod=mask_mod,
        block_tensors=tables,
        layout=spec.layout,
        mask_buffers=mask_buffers,
        scale=scale,
        score_buffers=score_buffers,
        return_lse=True,
    )


@functools.cache
def tree_attention_fn(spec: AttentionSpec) -> Callable:
    """The function a rewritten graph calls in place of a causal attention.

    Returns ``fn(q, k, v, positions, *mask_buffers, *block_tensors) -> [B, Hq, S, Dv]``.
    One function object per distinct spec, so all layers with the same spec share it.
    """
    n_buf = len(MASK_KINDS[spec.kind])
    mask_mod = tree_mask_mod(spec.kind, chunks=spec.chunks, window=spec.window)
    score_mod = softcap_score_mod(spec.softcap)

    def tree_flex_attention(q, k, v, positions, *tensors, sinks=None, sink_values=None, mod_buffers=()):
        q, k, v = _common_dtype(q, k, v)
        buffers = tuple(tensors[:n_buf])
        tables = BlockTensors(*tensors[n_buf:])
        if spec.window is not None or spec.mods and user_mods(spec.mods).mask is not None:
            tables = demote_full_blocks(tables)  # a full block skips the mask_mod
        scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if q.device.type == "cpu":
            # FlexAttention has no sparse CPU kernel (its op evaluates all S x S pairs):
            # walk the live blocks instead, exact and without S x S memory.
            if spec.window is not None or spec.alibi or spec.mods:
                buffers = (*buffers, positions, *mod_buffers)
            out, lse = torch.ops.treecompile.tree_attention_cpu(
                q, k, v, list(buffers), tables.kv_num_blocks, tables.kv_indices, tables.full_kv_num_blocks,
                tables.full_kv_indices, spec.kind, _block_size(spec.layout), float(scale),
                float(spec.softcap or 0.0), int(spec.window or 0), int(spec.chunks),
                list(spec.alibi) if spec.alibi else None, spec.mods or "",
            )
        else:
            out, lse = _flex_hop_attention(spec, mask_mod, score_mod, q, k, v, positions, buffers, tables, scale,
                                           tuple(mod_buffers))
        return out if sinks is None else _with_sinks(out, lse, sinks, sink_values)

    parts = [spec.kind, f"w{spec.window}" if spec.window else "", "softcap" if spec.softcap else "",
             "alibi" if spec.alibi else "", "sinks" if spec.sinks else "",
             user_mods(spec.mods).name if spec.mods else ""]
    tree_flex_attention.__name__ = "tree_flex_attention_" + "_".join(p for p in parts if p)
    tree_flex_attention.spec = spec  # read by the streaming pass (passes/stream.py)
    return tree_flex_attention
