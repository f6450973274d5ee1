"""torch's recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``) as one op each, and their tree form.

Under capture, ``torch.nn.modules.rnn._VF`` is swapped (`VF_FOR_CAPTURE`, through
`treecompile.capture.dynamo.TORCH_SWAPS`) so that each layer's call of ``_VF.lstm`` /
``_VF.gru`` / ``_VF.rnn_tanh`` / ``_VF.rnn_relu`` becomes one ``treecompile::rnn`` node, whose
shapes follow the length symbolically (torch's own ops trace the recurrence step by step, which
makes the length a constant). The SSM state pass replaces each node by ``treecompile::tree_rnn``:
every tree node's rows run from its parent node's final states (every layer's ``h``, and ``c``
for an LSTM), the roots from the call's initial state, with torch's own kernel per node
(``_VF.<mode>`` over the node's rows). By induction over the nodes in preorder, a node's
initial state is the state after its whole root path, as per-path training has it.

The backward (``treecompile::tree_rnn_backward``) runs the nodes again with autograd and
takes the gradients of the inputs, the initial state and the weights: the same graph as
per-path training, whose gradients the children's states add into the parent's. The work is
one kernel call per tree node (forward, and twice backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from treecompile.kernels.scans.recurrence import autograd_inside

__all__ = ["rnn", "tree_rnn", "VF_FOR_CAPTURE", "MODES"]

#: ``_VF`` function -> (mode, number of state tensors).
MODES = {"lstm": 2, "gru": 1, "rnn_tanh": 1, "rnn_relu": 1}


def _call(mode: str, x: Tensor, hx: list[Tensor], weights: list[Tensor], has_biases: bool, num_layers: int,
          dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> list[Tensor]:
    fn = getattr(torch._VF, mode)
    state: Any = tuple(hx) if mode == "lstm" else hx[0]
    out = fn(x, state, weights, has_biases, num_layers, dropout, train, bidirectional, batch_first)
    return list(out)


def _run_tree(mode: str, x: Tensor, hx: list[Tensor], weights: list[Tensor], has_biases: bool, num_layers: int,
              batch_first: bool, node_table: Tensor) -> list[Tensor]:
    """Every tree node's rows from its parent's final states: ``[output]`` over the packed row."""
    d = 1 if batch_first else 0
    outs: list[Tensor] = []
    finals: list[list[Tensor]] = []
    for start, end, parent in node_table.tolist():
        state = finals[parent] if parent >= 0 else hx
        out, *final = _call(mode, x.narrow(d, start, end - start), state, weights, has_biases, num_layers, 0.0,
                            False, False, batch_first)
        outs.append(out)
        finals.append(final)
    return [torch.cat(outs, d)]


def _shapes(mode: str, x: Tensor, hx: list[Tensor], weights: list[Tensor], bidirectional: bool,
            batch_first: bool) -> list[Tensor]:
    hidden = weights[1].shape[1]
    dirs = 2 if bidirectional else 1
    b, t = (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])
    out = x.new_empty((b, t, dirs * hidden) if batch_first else (t, b, dirs * hidden))
    return [out, *(h.new_empty(h.shape) for h in hx[:MODES[mode]])]


@torch.library.custom_op("treecompile::rnn", mutates_args=())
def rnn(x: Tensor, hx: list[Tensor], weights: list[Tensor], mode: str, has_biases: bool, num_layers: int,
        dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> list[Tensor]:
    """``_VF.<mode>(x, hx, weights, ...)`` as one op: ``[output, h_n]`` (``[output, h_n, c_n]``
    for an LSTM). The SSM state pass replaces every one: by `tree_rnn` over the packed rows,
    else by torch's own call (no autograd of its own is needed)."""
    return _call(mode, x, hx, weights, has_biases, num_layers, dropout, train, bidirectional, batch_first)


@rnn.register_fake
def _rnn_fake(x, hx, weights, mode, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    return _shapes(mode, x, hx, weights, bidirectional, batch_first)


@torch.library.custom_op("treecompile::tree_rnn", mutates_args=())
def tree_rnn(x: Tensor, hx: list[Tensor], weights: list[Tensor], mode: str, has_biases: bool, num_layers: int,
             batch_first: bool, node_table: Tensor) -> Tensor:
    """The layer on a tree packed in one row (batch 1): each node of ``node_table`` (``[N, 3]``
    CPU: start, end, parent; parents first) from its parent's final states, the roots from
    ``hx``. Returns the output over the packed row."""
    with torch.no_grad():
        return _run_tree(mode, x, hx, weights, has_biases, num_layers, batch_first, node_table)[0]


@tree_rnn.register_fake
def _tree_rnn_fake(x, hx, weights, mode, has_biases, num_layers, batch_first, node_table):
    return _shapes(mode, x, hx, weights, False, batch_first)[0]


@torch.library.custom_op("treecompile::tree_rnn_backward", mutates_args=())
def tree_rnn_backward(grad: Tensor, x: Tensor, hx: list[Tensor], weights: list[Tensor], mode: str,
                      has_biases: bool, num_layers: int, batch_first: bool, node_table: Tensor) -> list[Tensor]:
    """Gradients of `tree_rnn`'s output: ``[d x, *d hx, *d weights]`` (the nodes run again with
    autograd)."""
    with autograd_inside():
        leaves = [t.detach().requires_grad_(True) for t in (x, *hx, *weights)]
        lx, lh, lw = leaves[0], leaves[1:1 + len(hx)], leaves[1 + len(hx):]
        out = _run_tree(mode, lx, lh, lw, has_biases, num_layers, batch_first, node_table)[0]
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


@tree_rnn_backward.register_fake
def _tree_rnn_backward_fake(grad, x, hx, weights, mode, has_biases, num_layers, batch_first, node_table):
    return [torch.empty_like(t) for t in (x, *hx, *weights)]


def _setup(ctx, inputs, output):
    x, hx, weights, mode, has_biases, num_layers, batch_first, node_table = inputs
    ctx.save_for_backward(x, *hx, *weights)
    ctx.states = len(hx)
    ctx.args = (mode, has_biases, num_layers, batch_first, node_table)


def _backward(ctx, grad):
    saved = ctx.saved_tensors
    nh = ctx.states
    x, hx, weights = saved[0], list(saved[1:1 + nh]), list(saved[1 + nh:])
    grads = torch.ops.treecompile.tree_rnn_backward(grad.contiguous(), x, hx, weights, *ctx.args)
    return grads[0], list(grads[1:1 + nh]), list(grads[1 + nh:]), None, None, None, None, None


tree_rnn.register_autograd(_backward, setup_context=_setup)


def _drop_in(mode: str):
    def call(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        if not torch.compiler.is_compiling():  # another thread's eager call while the swap holds: torch's own
            return getattr(torch._VF, mode)(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                                            batch_first)
        states = list(hx) if isinstance(hx, (tuple, list)) else [hx]
        out = torch.ops.treecompile.rnn(input, states, list(params), mode, has_biases, num_layers, float(dropout),
                                        train, bidirectional, batch_first)
        return tuple(out)  # (output, h_n) or, for an LSTM, (output, h_n, c_n), as _VF returns them

    call.__name__ = mode
    return call


class _CaptureVF:
    """``torch.nn.modules.rnn._VF`` for a captured call: the four sequence functions are the
    drop-ins above (a packed sequence's ``batch_sizes`` form has another signature and is left
    to fail the capture by name); every other name is torch's."""

    def __init__(self) -> None:
        for mode in MODES:
            setattr(self, mode, _drop_in(mode))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch._VF, name)


#: The ``_VF`` a captured call's ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` see.
VF_FOR_CAPTURE = _CaptureVF()
