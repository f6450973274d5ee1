"""A Python branch of the model on the sequence length, checked where a batch's paths take its
other side.

A captured graph holds the side of ``if T > 8: ...`` its row count takes; per-path training
takes each path's (`treecompile.passes.length_branches`). Most such branches choose between two
spellings of one function (nanochat's ``if window >= T: causal SDPA else a windowed mask``, H3's
``if k.size(-1) < L: pad k``), and the graph's side is then exact for every path; some do not
(``x = x * 0.5``). After a call whose batch has a path on the other side of a line not judged
yet, :func:`judge_length_branches` runs a copy of the unmodified model on one such path (no
gradients, the random state forked) and compares its log-probabilities with the path's rows of
the call, to the probe's rounding (`treecompile.compile.probe.PROBE_TOLERANCE`):

- equal: the line is settled for the graph (both sides compute the same there);
- different: the call is refused (`LengthBranchRefused`, naming the line and the length), and
  so is every later batch with a path on that side, before the graph runs; batches whose paths
  all take the graph's side run.

Where no copy can run (``verify=False``, a context-parallel or FSDP2-sharded call, a model over
`treecompile.compile.selfcheck.VERIFY_COPY_LIMIT_BYTES`, a model that draws random numbers in
its mode) the line is warned about instead (`LengthBranchWarning`), once.
"""

from __future__ import annotations

from typing import Any

import torch

from treecompile.core.batch import TreeBatch
from treecompile.core.errors import BatchRefused
from treecompile.core.reference import model_copy
from treecompile.passes.length_branches import BranchVerdicts, LengthBranch

__all__ = ["LengthBranchRefused", "forget_pending", "judge_length_branches"]


class LengthBranchRefused(BatchRefused):
    """A batch with a path on the other side of a Python branch of the model on the sequence
    length than its packed row, where the two sides compute differently: refused (batches whose
    paths all take the packed row's side run)."""


def forget_pending(records: list) -> None:
    """Clears what earlier calls left to judge (a call that failed judges nothing)."""
    for record in records:
        record.branch_verdicts.pending.clear()


def judge_length_branches(wrapper: Any, batch: TreeBatch, logprobs: torch.Tensor | None) -> None:
    """Judges every line the call's paths took the other way for (``BranchVerdicts.pending`` of
    the wrapper's graphs), from the call's ``logprobs`` ``[S]`` of ``batch``; raises
    `LengthBranchRefused` where the model computes otherwise on such a path."""
    for record in wrapper.compile_records:
        verdicts: BranchVerdicts = record.branch_verdicts
        pending, verdicts.pending = verdicts.pending, []
        for branch, other in pending:
            if verdicts.settled(branch.where) or branch.where in verdicts.refused:
                continue
            why = _cannot_check(wrapper, logprobs)
            if why is None:
                refusal = _check(wrapper, record, batch, logprobs, branch, other)
                if refusal is None:
                    verdicts.same.add(branch.where)
                    continue
                if isinstance(refusal, str):
                    why = refusal
                else:
                    verdicts.refused[branch.where] = refusal
                    raise refusal
            verdicts.warn(branch, other, why, stacklevel=4)


def _cannot_check(wrapper: Any, logprobs: torch.Tensor | None) -> str | None:
    """Why no copy of the model can be run on a path here, or None."""
    from treecompile.compile.selfcheck import VERIFY_COPY_LIMIT_BYTES

    if not wrapper.verify.probes:
        return "tree_compile(verify=False)"
    if wrapper._cp is not None or wrapper._fsdp is not None:
        return "the model runs sharded"
    if logprobs is None:
        return "the call returned no log-probabilities"
    size = sum(t.numel() * t.element_size() for t in [*wrapper._inner.parameters(), *wrapper._inner.buffers()])
    if size > VERIFY_COPY_LIMIT_BYTES:
        return f"the model is larger than {VERIFY_COPY_LIMIT_BYTES >> 30} GiB, too large to copy for the check"
    return None


def _check(wrapper: Any, record: Any, batch: TreeBatch, logprobs: torch.Tensor, branch: LengthBranch,
           other: tuple[int, ...]) -> LengthBranchRefused | str | None:
    """The copy of the model on the batch's shortest and longest path on the other side against
    the call's rows (to the rounding of the least precise of the model's dtype, its graph's
    products and its logits): None if equal, the refusal if not, or why it could not be run."""
    from treecompile.compile.probe import PROBE_TOLERANCE, less_precise, rounding_dtype, wrapper_dtype

    wanted = {min(other), max(other)}
    rows_of = {}
    ends = batch.path_node.tolist()
    for p in range(batch.num_paths):
        rows = batch.path_rows(p) if ends[p] >= 0 else ()
        if len(rows) in wanted and len(rows) not in rows_of:
            rows_of[len(rows)] = rows
    if not rows_of:
        return "no path of the batch has the length that took the other side"
    try:
        twin = model_copy(wrapper._inner)
    except Exception as e:  # a model that cannot be deep-copied
        return f"the model could not be copied ({type(e).__name__})"
    computes = wrapper_dtype(wrapper)
    if record.graph_module is not None:
        computes = rounding_dtype(record.graph_module, computes)
    for n, rows in sorted(rows_of.items()):
        ids = batch.input_ids[rows.to(batch.input_ids.device)]
        try:
            (first, logits_dtype), (again, _) = (_path_logprobs(twin, ids, wrapper.temperature, seed) for seed in (0, 1))
        except Exception as e:  # the model's own error on the path alone: no verdict, said as such
            return f"the model run on a path alone raised {type(e).__name__}"
        if not torch.equal(first, again):
            return "the model draws random numbers in its mode (dropout in training mode)"
        if logits_dtype.is_floating_point:
            computes = less_precise(computes, logits_dtype)
        tol = PROBE_TOLERANCE.get(computes, 1e-3)
        got = logprobs.detach()[rows.to(logprobs.device)][1:].double()
        ref = first[1:].double().to(got.device)
        diff = ((got - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
        if not diff <= tol:
            return LengthBranchRefused(
                f"treecompile cannot train this batch exactly: a Python branch of the model on the sequence length "
                f"at {branch.where} goes the other way for a path of {n} tokens than for the packed row, and the two "
                f"sides compute otherwise there (log-probabilities differ by {diff:.3g} relative, tolerance {tol:g}).\n"
                f"  The graph holds the side its row count {branch.symbol} takes ({branch.expr}); per-path training "
                f"takes each path's, and the model run on this path alone takes the other. Batches whose paths all "
                f"take the graph's side run (batches are packed into one row: the branch is decided at its row count)."
            )
    return None


def _path_logprobs(model: torch.nn.Module, ids: torch.Tensor, temperature: float,
                   seed: int) -> tuple[torch.Tensor, torch.dtype]:
    """``[T]`` log-probabilities of the path ``ids`` under ``model`` (entry 0 is 0), with the
    wrapper's temperature, under ``seed`` (the caller's random state untouched); and the dtype
    of the model's logits."""
    from treecompile.core.reference import model_logits

    devices = [ids.device] if ids.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        logits = model_logits(model, ids[None])[0]
    picked = torch.log_softmax(logits[:-1].double() / temperature, dim=-1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([picked.new_zeros(1), picked]), logits.dtype
