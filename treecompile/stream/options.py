"""Streaming execution: a tree larger than the row budget, trained exactly with a KV stack.

    model = tree_compile(model, stream=StreamOptions(budget_rows=4096))
    out = model(batch)        # a batch over 4096 rows streams; smaller ones run as one call

(``StreamOptions(budget_bytes=B)`` instead: the whole step within B bytes, parts chosen per
batch by `choose_stream` from `treecompile.planning.budget`'s cost model; see `stream_peak_bytes`.)
    out.loss.backward()       # the same gradients as per-path training

The packed row (depth-first) is cut into parts of at most ``budget_rows`` consecutive rows;
every row is in exactly one part, so no token is computed twice (a part may start inside a
node). Parts run in row order. A part's attention reads, per layer, the keys and values of
the rows before it on the root path of its first row (its *prefix*: the KV stack), from the
earlier parts that computed them, besides its own (`treecompile.passes.stream`); in a
hybrid model its causal convs read the prefix rows' conv inputs the same way, and its
recurrent layers start from the states after its *entry rows* (`BatchArrays.structure`),
which the parts holding those rows read out. Its gradients with respect to what it read
are added into the stack entries of the parts that produced them; a part runs its own
backward once every later part that reads it has run its backward (see `StreamPlan`), so
each part's graph lives only while a descendant part still needs it.

Modes (`StreamOptions.mode`):

* ``"keep"``: a part keeps its autograd graph while it is on the stack; each part runs
  forward once and backward once (the effective reuse ratio equals the POR).
* ``"recompute"``: a part that later parts read keeps only its keys and values (detached)
  and is run forward again, with grad, when its backward is due; at most one part's graph
  is alive at a time, for one extra forward of such parts (AReaL-DTA's trade).

The backward runs during the call (it must, to free each part's graph); the gradients are
held aside and land on the parameters when ``out.loss.backward()`` is called, scaled by
the gradient it receives. So only losses expressed through the batch's ``target_weight``
(every loss mode) stream, plus a MoE model's router auxiliary loss (from the parts' router
sums, with one more forward pass without a graph for its gradient; see
`RouterAux.tree_stats`); ``out.logprobs`` and ``out.entropy`` are values (no gradient) in a
streamed call.
"""

from __future__ import annotations

from treecompile.stream.parts import PAD_PREFIX, PAD_STATES  # noqa: F401  (re-exported: the part layout's padding)
from treecompile.stream.plan import (CUTS, MODES, StreamChoice, StreamOptions, StreamPlan, StreamStats, choose_stream,
                                     plan_stream, stream_cost_model, stream_peak_bytes)
from treecompile.stream.plan import plan_stream_report  # noqa: F401  (re-exported for ``treecompile plan --stream``)
from treecompile.stream.runner import StreamRunner, stream_logprob_loss

__all__ = ["MODES", "CUTS", "StreamOptions", "StreamPlan", "StreamStats", "plan_stream", "StreamRunner", "stream_logprob_loss",
           "stream_cost_model", "StreamChoice", "choose_stream", "stream_peak_bytes"]
