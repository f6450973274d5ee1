"""``tree_compile(verify=True)``: the compiled model checked against per-path training.

On the first call the wrapper runs :func:`verify_tree_compile`: a small random tree with
every awkward feature, the compiled model against the unmodified model on each path, loss
and every parameter's gradient, in float64 on a CPU copy where it fits (and where the model's
own code runs in float64; else on the model itself, in its dtype). A model wrapped with
``stream=`` is checked again at its first streamed call, streamed: the same check tree cut
into parts of `VERIFY_STREAM_BUDGET_ROWS` rows in the wrapper's mode and cuts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from treecompile.core.batch import TreeBatch
from treecompile.capture.dynamo import plain_experts, swapped_kernels
from treecompile.core.errors import UnsupportedModelError
from treecompile.core.tree import TrajectoryTree

if TYPE_CHECKING:
    from treecompile.stream.plan import StreamOptions, StreamStats

__all__ = ["VerifyReport", "verify_tree_compile", "VERIFY_GRAD_TOLERANCE", "VERIFY_COPY_LIMIT_BYTES",
           "VERIFY_STREAM_BUDGET_ROWS"]


@dataclass
class VerifyReport:
    """What ``verify=True`` checked.

    Attributes:
        dtype: the dtype the check ran in.
        paths: paths of the check tree.
        loss_diff: ``|tree loss - per-path loss|``.
        worst_param: the parameter whose gradient differs most (relative to its largest entry).
        worst_grad_diff: that relative difference.
        tolerance: the relative tolerance applied.
        stream: for the check of a streamed call, what the streamed check run did (parts,
            stack depth, rows, budget); None for a whole-tree call.
    """

    dtype: torch.dtype
    paths: int
    loss_diff: float
    worst_param: str
    worst_grad_diff: float
    tolerance: float
    stream: StreamStats | None = None


# verify=True: largest gradient difference allowed, relative to the gradient's largest entry,
# by the dtype the check runs in. float64: HF norms compute in float32 (a ~1e-7 floor), with
# margin; a structural error (wrong mask, position or weight) shows as 1e-4 or worse.
VERIFY_GRAD_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
# A float64 copy larger than this is not made; the check then runs on the model itself.
VERIFY_COPY_LIMIT_BYTES = 2 << 30
# The rows per part of the streamed check. The check tree's longest path has 9 rows, so it
# spans at least 3 parts: its last part reads at least two earlier ones from the stack.
VERIFY_STREAM_BUDGET_ROWS = 4


def _check_tree(batch: TreeBatch, seed: int = 0) -> TrajectoryTree:
    """A small tree with every awkward feature: a branch point, a 1-token node, a path that
    ends inside another, a duplicate path and a second root. Tokens are drawn from the batch,
    so they are valid ids for the model."""
    g = torch.Generator().manual_seed(seed)
    ids = batch.input_ids.cpu()

    def draw(n: int) -> list[int]:
        return ids[torch.randint(0, ids.shape[0], (n,), generator=g)].tolist()

    root, a, b, c = draw(5), draw(1), draw(4), draw(3)
    if len({a[0], b[0], c[0]}) < 3:  # children must start differently to branch
        a, b, c = [0], [1], [2]
    seqs = [root + a + draw(3), root + b, root + b + draw(2), root + c, root + c, draw(4)]
    return TrajectoryTree.from_sequences(seqs, weights=[1.0, 0.5, 2.0, 1.0, 1.0, 1.5])


def verify_tree_compile(compiled: Any, batch: TreeBatch, stream: StreamOptions | None = None) -> VerifyReport:
    """Checks a tree-compiled model (a `treecompile.TreeCompiledModel`) against per-path
    training on a small random tree.

    Runs the model's compiled form and the unmodified model on each path (a hybrid model's
    sequence kernels swapped, on both sides, for treecompile's ops of the same
    linear-sequence semantics), compares the loss and every parameter's gradient, and
    raises `UnsupportedModelError` naming the parameter that differs most. The user's model, its gradients and its train/eval mode are left as
    they were.

    With ``stream`` (the wrapper's `treecompile.stream.options.StreamOptions`) the streamed variant
    is checked instead: the check tree runs in parts of `VERIFY_STREAM_BUDGET_ROWS` rows, in
    ``stream``'s mode and cuts, with ancestors' keys and values (and states) on the stack;
    the report's ``stream`` says what that run did.
    """
    from treecompile.core.batch import pack
    from treecompile.core.reference import model_copy

    model = compiled.model
    n_bytes = sum(p.numel() for p in model.parameters()) * 8
    tree = _check_tree(batch)
    check_batch = pack(tree, loss_mode=batch.loss_mode, path_bits=compiled.mask == "bitmask", warn_por=False)
    if n_bytes <= VERIFY_COPY_LIMIT_BYTES:
        subject = model_copy(model).to(device="cpu", dtype=torch.float64)
        plain_experts(subject)
        try:
            return _check(compiled, subject, tree, check_batch, stream)
        except UnsupportedModelError:
            raise
        except Exception:  # the model's own code cannot run in float64 (a cast to float32 before a float64 weight)
            pass
    return _check(compiled, model, tree, check_batch, stream)


def _check(compiled: Any, subject: torch.nn.Module, tree: TrajectoryTree, check_batch: TreeBatch,
           stream: StreamOptions | None) -> VerifyReport:
    """The check on ``subject``: a float64 CPU copy of the model, or the model itself."""
    from treecompile.core.reference import per_path_loss

    model = compiled.model
    was_training = model.training
    saved = {n: p.grad for n, p in model.named_parameters()}
    dtype = next(subject.parameters()).dtype
    try:
        subject.eval()  # dropout would make the two runs differ for no fault of the tree
        for p in subject.parameters():
            p.grad = None
        # The twin has the wrapper's options but the check itself (the wrapper would check
        # again, without end) and the temperature (a division the reference does not make); a
        # copy runs on the CPU, so not inductor's lowering either (a CUDA choice). A model too
        # large to copy is checked in place, through a twin of its own.
        options = {**compiled._options(), "verify": False, "temperature": 1.0}
        if subject is not model and options["backend"] == "inductor":
            options["backend"] = None
        if stream is not None:
            # The mode the checked call ran in (a byte budget's "auto" chooses per batch).
            ran = compiled._stream.stats if compiled._stream is not None else None
            mode = stream.mode if stream.mode != "auto" else (ran.mode if ran is not None else "keep")
            stream = dataclasses.replace(stream, budget_rows=VERIFY_STREAM_BUDGET_ROWS, budget_bytes=None, mode=mode)
        twin = type(compiled)(subject, **options, stream=stream)
        with torch.enable_grad():  # the first call may be a no-grad one (a rollout's log-probs)
            loss = twin(check_batch.to(next(subject.parameters()).device)).loss
            loss.backward()
        stats = None if stream is None else twin._stream.stats
        tree_grads = {n: p.grad for n, p in subject.named_parameters()}
        for p in subject.parameters():
            p.grad = None
        router = compiled._router_aux
        # A hybrid model's per-path run uses the same linear-sequence kernels the tree side was
        # swapped to (tested against HF's): HF's GDN fallback computes in float32 even in a
        # float64 model, which would put a float32 floor under this float64 check. (The twin's:
        # a layer that keeps its kernel as an attribute has it swapped on the copy checked.)
        with swapped_kernels(twin._kernels):
            with torch.enable_grad():
                ref = per_path_loss(subject, tree, router_aux_loss_coef=None if router is None else router.coef)
                ref.loss.backward()
        worst, worst_name = 0.0, ""
        for n, p in subject.named_parameters():
            r, t = p.grad, tree_grads[n]
            if r is None and t is None:
                continue
            r = torch.zeros_like(p) if r is None else r
            t = torch.zeros_like(p) if t is None else t
            err = ((t - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
            if err >= worst:
                worst, worst_name = err, n
        tol = VERIFY_GRAD_TOLERANCE.get(dtype, 1e-3)
        loss_diff = abs(loss.item() - ref.loss.item())
        report = VerifyReport(dtype, tree.num_paths, loss_diff, worst_name, worst, tol, stats)
        what = "tree-compiled model" if stats is None else (
            f"streamed tree-compiled model ({stats.parts} parts of at most {stats.budget_rows} rows, stack depth "
            f"{stats.stack_depth}, {stream.mode} mode, {stream.cuts} cuts)")
        flag = "" if stats is None else f" --stream-rows {stats.budget_rows}"
        if worst > tol or not loss_diff <= tol * max(1.0, abs(ref.loss.item())):
            raise UnsupportedModelError(
                f"verify: the {what} disagrees with per-path training on a {tree.num_paths}-path "
                f"check tree ({dtype}): loss differs by {loss_diff:.3g}; gradient of {worst_name!r} differs by "
                f"{worst:.3g} of its largest entry (tolerance {tol:g}). The model does something the passes do "
                f"not make tree-exact; inspect the rewritten graph with `treecompile inspect{flag}`."
            )
        return report
    finally:
        for n, p in model.named_parameters():
            p.grad = saved[n]
        model.train(was_training)
