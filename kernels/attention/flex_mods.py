"""A model's own FlexAttention ``score_mod`` / ``mask_mod``, evaluated on a tree.

A model that calls ``flex_attention(q, k, v, score_mod=f, block_mask=create_block_mask(m,
...))`` computes, per path, ``f(score, b, h, q_idx, kv_idx, *score_buffers)`` and keeps the
pairs where ``m(b, h, q_idx, kv_idx, *mask_buffers)`` holds, with ``q_idx`` and ``kv_idx``
the two tokens' offsets on the path. On the tree the same functions run with the two rows'
path positions in their place (``positions[q]``, ``positions[kv]``), and the mask is ANDed
with the tree rule: the same scores, and of the pairs on the query's path the same ones kept.
That is exact as long as the functions read the indices only as positions: the attention
pass refuses buffers computed from the tokens, and buffers indexed by a per-token array
(a dim of the sequence's length, e.g. document ids).

The functions are the captured ``GraphModule`` s of the model's ``score_mod`` and
``mask_mod``; a rewritten graph names them by a key (`register_mods`), since a custom op
takes no function arguments.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["UserMods", "register_mods", "chunk_mods", "user_mods", "tile_scores", "tile_mask", "score_vjp"]


@dataclass(frozen=True)
class UserMods:
    """A model's own score and mask functions, and how many buffers each reads.

    Attributes:
        score: ``score(score, b, h, q_idx, kv_idx, *score_buffers)``, or None.
        mask: ``mask(b, h, q_idx, kv_idx, *mask_buffers) -> bool``, or None.
        n_score: buffers of ``score`` (they come first in the call's list).
        n_mask: buffers of ``mask`` (after the score's).
        name: for dumped graphs.
    """

    score: Callable | None
    mask: Callable | None
    n_score: int
    n_mask: int
    name: str

    def split(self, buffers: Sequence[torch.Tensor]) -> tuple[tuple, tuple]:
        return tuple(buffers[:self.n_score]), tuple(buffers[self.n_score:self.n_score + self.n_mask])


_MODS: dict[str, UserMods] = {}
_KEYS = itertools.count()


def register_mods(score: Callable | None, mask: Callable | None, n_score: int, n_mask: int) -> str:
    """Registers a model's functions; returns the key an `AttentionSpec` carries."""
    key = f"mods{next(_KEYS)}"
    parts = [p for p in ("score" if score is not None else "", "mask" if mask is not None else "") if p]
    _MODS[key] = UserMods(score, mask, n_score, n_mask, f"{'_'.join(parts)}_{key}")
    return key


_CHUNKS: dict[int, str] = {}


def chunk_mods(chunk: int) -> str:
    """The key of a mask_mod keeping keys in the query's chunk of ``chunk`` tokens (positions
    ``q // chunk == kv // chunk``): Llama 4's chunked attention, which ANDed with the tree
    rule keeps the ancestors in the query's chunk of its path."""
    if chunk not in _CHUNKS:
        def same_chunk(b, h, q_idx, kv_idx):
            return q_idx // chunk == kv_idx // chunk

        same_chunk.__name__ = f"chunk{chunk}"
        _CHUNKS[chunk] = register_mods(None, same_chunk, 0, 0)
    return _CHUNKS[chunk]


_DISTANCES: dict[int, str] = {}


def distance_mods(length: int) -> str:
    """The key of a mask_mod keeping the keys at the distances a table allows (``tab[d]`` for
    ``d = positions[q] - positions[kv]``, ``length`` entries): a causal mask of any pattern of
    the distance (OpenAI's Sparse Transformer's strided heads, a dilated window), ANDed with
    the tree rule."""
    if length not in _DISTANCES:
        def allowed_distance(b, h, q_idx, kv_idx, tab):
            return tab[(q_idx - kv_idx).clamp(0, length - 1)]

        allowed_distance.__name__ = f"distances{length}"
        _DISTANCES[length] = register_mods(None, allowed_distance, 0, 1)
    return _DISTANCES[length]


def user_mods(key: str) -> UserMods:
    return _MODS[key]


def _over_tiles(fn: Callable, n_lead: int) -> Callable:
    """``fn`` over index tiles: ``vmap`` over heads, then query rows, then key rows (as
    FlexAttention evaluates a mod: scalar indices, whatever the function does with them)."""
    from torch.func import vmap

    inner = fn
    # Innermost: key rows; then query rows; then heads (each result stacked in front, which
    # gives [H, Bq, L]). The leading ``n_lead`` arguments (the score) are mapped along.
    inner = vmap(inner, in_dims=(*([-1] * n_lead), None, None, None, 0), out_dims=0)
    inner = vmap(inner, in_dims=(*([-2] * n_lead), None, None, 0, None), out_dims=0)
    inner = vmap(inner, in_dims=(*([-3] * n_lead), None, 0, None, None), out_dims=0)
    return inner


def _on_tiles(fn: Callable, lead: tuple, b: torch.Tensor, heads: torch.Tensor, q_pos: torch.Tensor,
              kv_pos: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``fn(*lead, b, h, q, kv)`` on the tile ``[H, Bq, L]``: with broadcast index tensors (mods
    written for scalars are element-wise in the indices, and this runs under any dispatch
    mode), else, if that fails or gives another shape, by `_over_tiles`."""
    try:
        out = fn(*lead, b, heads[:, None, None], q_pos[None, :, None], kv_pos[None, None, :])
        if isinstance(out, torch.Tensor) and tuple(out.shape) == shape:
            return out
        if isinstance(out, torch.Tensor) and out.dim() <= 3:
            return torch.broadcast_to(out, shape)
    except (RuntimeError, IndexError, TypeError):
        pass
    return _over_tiles(fn, len(lead))(*lead, b, heads, q_pos, kv_pos)


def tile_scores(mods: UserMods, scores: torch.Tensor, heads: torch.Tensor, q_pos: torch.Tensor,
                kv_pos: torch.Tensor, buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """The model's ``score_mod`` on a tile of scores ``[H, Bq, L]`` (query heads ``heads``
    ``[H]``, the rows' path positions ``q_pos`` ``[Bq]`` and ``kv_pos`` ``[L]``)."""
    if mods.score is None:
        return scores
    score_bufs, _ = mods.split(buffers)
    b = torch.zeros((), dtype=torch.int32, device=scores.device)

    def one(score, b_, h, q, kv):
        return mods.score(score, b_, h, q, kv, *score_bufs)

    return _on_tiles(one, (scores,), b, heads, q_pos, kv_pos, tuple(scores.shape))


def tile_mask(mods: UserMods, heads: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor,
              buffers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The model's ``mask_mod`` on a tile ``[H, Bq, L]`` of path positions, or None."""
    if mods.mask is None:
        return None
    _, mask_bufs = mods.split(buffers)
    b = torch.zeros((), dtype=torch.int32, device=q_pos.device)

    def one(b_, h, q, kv):
        return mods.mask(b_, h, q, kv, *mask_bufs)

    shape = (heads.shape[0], q_pos.shape[0], kv_pos.shape[0])
    return _on_tiles(one, (), b, heads, q_pos, kv_pos, shape).bool()


def score_vjp(mods: UserMods, scores: torch.Tensor, heads: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor,
              buffers: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Callable]:
    """``(scores after the model's score_mod, vjp)``: ``vjp(d_out) -> (d_scores, [d_buffer, ...])``
    for the score_mod's buffers that are floating point (a learned bias table gets its
    gradient; index tables get None)."""
    score_bufs, mask_bufs = mods.split(buffers)
    diff = [i for i, t in enumerate(score_bufs) if t.dtype.is_floating_point]

    def f(s, *learned):
        bufs = list(score_bufs)
        for i, t in zip(diff, learned):
            bufs[i] = t
        return tile_scores(mods, s, heads, q_pos, kv_pos, [*bufs, *mask_bufs])

    out, vjp = torch.func.vjp(f, scores, *[score_bufs[i] for i in diff])

    def back(d_out: torch.Tensor) -> tuple[torch.Tensor, list]:
        d_scores, *d_learned = vjp(d_out)
        grads: list = [None] * len(buffers)
        for i, g in zip(diff, d_learned):
            grads[i] = g
        return d_scores, grads

    return out, back
