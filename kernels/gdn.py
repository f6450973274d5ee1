"""Gated DeltaNet (the gated delta rule) on a sequence and on a tree of segments.

The recurrence, per batch row and head, with state ``S`` ``[Dk, Dv]`` (Yang et al., 2025):

    S   <- exp(g_t) * S                       # decay
    u_t  = beta_t * (v_t - S^T k_t)           # delta-rule correction
    S   <- S + k_t u_t^T                      # write
    o_t  = S^T q_t                            # read

`gated_delta_rule_reference` is that loop, token by token, a definition a reader can check
by eye. Three ops are built on it:

* ``treecompile::gated_delta_rule(q, k, v, g, beta, initial_state)`` ``-> (out, final_state)``:
  the linear-sequence semantics of Hugging Face's ``torch_chunk_gated_delta_rule`` core
  (after its head repeat, L2 norm and query scaling, which :func:`hf_chunk_gated_delta_rule`
  does outside the op). The wrapper swaps the model's kernel for it before capture, so each
  GDN layer is one node the SSM state pass can find.
* ``treecompile::tree_gated_delta_rule(q, k, v, g, beta, initial_state, node_start,
  node_end, node_parent)`` ``-> out``: what the pass puts in its place. Each tree node's
  rows ``[node_start, node_end)`` run the recurrence from its *parent node's final state*
  (roots from ``initial_state``, or zeros), so every row sees exactly the state of its own
  path, never a sibling's. Nodes are processed in DFS preorder (a parent before its
  children), one after another.
* ``treecompile::gated_delta_rule_backward``: both ops' backward, from recomputed states.
  Per token, with ``S0`` the state before it, ``S1 = a S0`` (``a = exp(g)``) and ``S2`` after:
  ``dS2 = dS + q do^T``, ``dq = S2 do``, ``du = dS2^T k``, ``dk = dS2 u + S1 dkv``,
  ``dbeta = du . (v - S1^T k)``, ``dv = beta du``, ``dkv = -beta du``, ``dS1 = dS2 + k dkv^T``,
  ``dS0 = a dS1``, ``dg = a <dS1, S0>``. Nodes run in reverse preorder; each node's initial
  state gradient is added to its parent's final state gradient, so siblings sharing a
  parent's state sum their gradients into it, as autograd does per path.

All three compute in at least float32 (as HF's kernel does) and return the inputs' dtype.
Shapes: ``q, k`` ``[B, S, H, Dk]``, ``v`` ``[B, S, H, Dv]``, ``g, beta`` ``[B, S, H]``, states
``[B, H, Dk, Dv]``; node tables ``[N]`` int64. Query and value heads are equal here.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gated_delta_rule_reference", "gated_delta_rule", "tree_gated_delta_rule", "hf_chunk_gated_delta_rule"]

Tensor = torch.Tensor


def gated_delta_rule_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule, token by token, in the inputs' dtype.

    Returns:
        ``out`` ``[B, S, H, Dv]`` and the final state ``[B, H, Dk, Dv]``.
    """
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype).clone()
    out = q.new_zeros(b, s, h, dv)
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _nodes(s: int, node_start: Tensor | None, node_end: Tensor | None, node_parent: Tensor | None):
    """``[(start, end, parent)]`` in preorder; one root node over the row when no tables are given."""
    if node_start is None:
        return [(0, s, -1)]
    return list(zip(node_start.tolist(), node_end.tolist(), node_parent.tolist()))


def _segment(q, k, v, g, beta, state, a: int, b: int, out: Tensor) -> Tensor:
    """Runs rows ``[a, b)`` from ``state``; writes ``out`` rows; returns the final state."""
    o, final = gated_delta_rule_reference(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], state)
    out[:, a:b] = o
    return final


def _forward(q, k, v, g, beta, initial_state, node_start, node_end, node_parent):
    """``(out, final state of each node)`` in the compute dtype."""
    ct = _compute_dtype(q.dtype)
    q, k, v, g, beta = (x.to(ct) for x in (q, k, v, g, beta))
    b, s, h, dk = k.shape
    root = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(ct)
    out = q.new_zeros(b, s, h, v.shape[-1])
    finals: list[Tensor] = []
    for start, end, parent in _nodes(s, node_start, node_end, node_parent):
        # DFS preorder: the parent's final state is ready (parent < node).
        init = root if parent < 0 else finals[parent]
        finals.append(_segment(q, k, v, g, beta, init, start, end, out))
    return out, finals


def _backward(q, k, v, g, beta, initial_state, d_out, d_final, node_start, node_end, node_parent):
    """Gradients ``(dq, dk, dv, dg, dbeta, d_initial_state)`` in the inputs' dtypes."""
    dtypes = [x.dtype for x in (q, k, v, g, beta)]
    ct = _compute_dtype(q.dtype)
    q, k, v, g, beta, d_out = (x.to(ct) for x in (q, k, v, g, beta, d_out))
    b, s, h, dk = k.shape
    dvd = v.shape[-1]
    nodes = _nodes(s, node_start, node_end, node_parent)
    _, finals = _forward(q, k, v, g, beta, initial_state, node_start, node_end, node_parent)
    root = q.new_zeros(b, h, dk, dvd) if initial_state is None else initial_state.to(ct)
    grads = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
    dq, dk_, dv, dg, dbeta = grads
    d_root = torch.zeros_like(root)
    d_finals = [torch.zeros_like(root) for _ in nodes]
    if d_final is not None:
        d_finals[-1] = d_finals[-1] + d_final.to(ct)  # only used with one node (the linear op)
    for n in range(len(nodes) - 1, -1, -1):
        start, end, parent = nodes[n]
        state = root if parent < 0 else finals[parent]
        befores = []  # state before each token of the node
        for t in range(start, end):
            befores.append(state)
            s1 = state * g[:, t].exp()[..., None, None]
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", s1, k[:, t]))
            state = s1 + k[:, t, :, :, None] * u[:, :, None, :]
        d_state = d_finals[n]
        for i, t in reversed(list(enumerate(range(start, end)))):
            s0 = befores[i]
            a = g[:, t].exp()
            s1 = s0 * a[..., None, None]
            kt, qt, do = k[:, t], q[:, t], d_out[:, t]
            e = v[:, t] - torch.einsum("bhkv,bhk->bhv", s1, kt)
            u = beta[:, t, :, None] * e
            s2 = s1 + kt[..., None] * u[:, :, None, :]
            ds2 = d_state + qt[..., None] * do[:, :, None, :]
            dq[:, t] = torch.einsum("bhkv,bhv->bhk", s2, do)
            du = torch.einsum("bhkv,bhk->bhv", ds2, kt)
            dbeta[:, t] = (du * e).sum(-1)
            de = beta[:, t, :, None] * du
            dv[:, t] = de
            ds1 = ds2 - kt[..., None] * de[:, :, None, :]
            dk_[:, t] = torch.einsum("bhkv,bhv->bhk", ds2, u) - torch.einsum("bhkv,bhv->bhk", s1, de)
            dg[:, t] = a * (ds1 * s0).sum((-2, -1))
            d_state = ds1 * a[..., None, None]
        # Siblings share the parent's final state: their gradients add up there.
        if parent < 0:
            d_root = d_root + d_state
        else:
            d_finals[parent] = d_finals[parent] + d_state
    out = [x.to(dt) for x, dt in zip(grads, dtypes)]
    d_init = d_root if initial_state is None else d_root.to(initial_state.dtype)
    return (*out, d_init)


# ----------------------------------------------------------------------------- the ops


@torch.library.custom_op("treecompile::gated_delta_rule", mutates_args=())
def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule along the sequence: ``(out [B, S, H, Dv], final_state [B, H, Dk, Dv])``."""
    out, finals = _forward(q, k, v, g, beta, initial_state, None, None, None)
    return out.to(v.dtype), finals[-1].to(v.dtype)


@gated_delta_rule.register_fake
def _gated_delta_rule_fake(q, k, v, g, beta, initial_state):
    b, _, h, dk = k.shape
    return v.new_empty(v.shape), v.new_empty(b, h, dk, v.shape[-1])


@torch.library.custom_op("treecompile::tree_gated_delta_rule", mutates_args=())
def tree_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    node_start: Tensor,
    node_end: Tensor,
    node_parent: Tensor,
) -> Tensor:
    """The gated delta rule on a packed tree: ``out`` ``[B, S, H, Dv]``, each node from its parent's final state."""
    out, _ = _forward(q, k, v, g, beta, initial_state, node_start, node_end, node_parent)
    return out.to(v.dtype)


@tree_gated_delta_rule.register_fake
def _tree_gated_delta_rule_fake(q, k, v, g, beta, initial_state, node_start, node_end, node_parent):
    return v.new_empty(v.shape)


@torch.library.custom_op("treecompile::gated_delta_rule_backward", mutates_args=())
def gated_delta_rule_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    d_out: Tensor,
    d_final: Tensor | None,
    node_start: Tensor | None,
    node_end: Tensor | None,
    node_parent: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dbeta, d_initial_state)``; no node tables means one node over the row."""
    return _backward(q, k, v, g, beta, initial_state, d_out, d_final, node_start, node_end, node_parent)


@gated_delta_rule_backward.register_fake
def _gated_delta_rule_backward_fake(q, k, v, g, beta, initial_state, d_out, d_final, node_start, node_end,
                                    node_parent):
    b, _, h, dk = k.shape
    state_dtype = v.dtype if initial_state is None else initial_state.dtype
    return (*(torch.empty_like(x) for x in (q, k, v, g, beta)), v.new_empty(b, h, dk, v.shape[-1], dtype=state_dtype))


def _setup_linear(ctx, inputs, output):
    q, k, v, g, beta, init = inputs
    ctx.has_init = init is not None
    ctx.save_for_backward(q, k, v, g, beta, init)


def _backward_linear(ctx, d_out, d_final):
    q, k, v, g, beta, init = ctx.saved_tensors
    grads = torch.ops.treecompile.gated_delta_rule_backward(
        q, k, v, g, beta, init, d_out, d_final, None, None, None
    )
    return (*grads[:5], grads[5] if ctx.has_init else None)


def _setup_tree(ctx, inputs, output):
    q, k, v, g, beta, init, node_start, node_end, node_parent = inputs
    ctx.has_init = init is not None
    ctx.save_for_backward(q, k, v, g, beta, init, node_start, node_end, node_parent)


def _backward_tree(ctx, d_out):
    q, k, v, g, beta, init, node_start, node_end, node_parent = ctx.saved_tensors
    grads = torch.ops.treecompile.gated_delta_rule_backward(
        q, k, v, g, beta, init, d_out, None, node_start, node_end, node_parent
    )
    return (*grads[:5], grads[5] if ctx.has_init else None, None, None, None)


gated_delta_rule.register_autograd(_backward_linear, setup_context=_setup_linear)
tree_gated_delta_rule.register_autograd(_backward_tree, setup_context=_setup_tree)


# ----------------------------------------------------------------------------- HF adapter


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    # HF's (and fla's) l2norm: x / sqrt(sum(x^2) + eps), over the head dim only (token-wise).
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def hf_chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Drop-in for HF's ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``.

    Same arguments and result (``[B, S, Hv, Dv]`` and the final state or None); the chunk size
    only changes how HF's kernel sums, not what it computes. The token-wise preparation
    (head repeat, L2 norm, ``Dk^-0.5`` query scaling, in at least float32 as HF does) runs
    here, the recurrence in ``treecompile::gated_delta_rule``.
    """
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("treecompile's gated delta rule keeps packed sequences apart itself: pass no cu_seqlens")
    dtype = query.dtype
    ct = _compute_dtype(dtype)
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    query, key, value, g, beta = (x.to(ct) for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    out, final = torch.ops.treecompile.gated_delta_rule(query, key, value, g, beta, initial_state)
    return out.to(dtype), (final if output_final_state else None)
