"""RL data in the shapes RL users have, turned into trees and `treecompile.rl.losses.RLBatch` es.

* GRPO groups: one prompt, n completions, n rewards (`group_advantages`, `grpo_group`);
* multi-turn trajectories where every assistant turn is a sample (`multi_turn_sample`);
* explicit tree-search rollouts (Tree of Thoughts' game-of-24 search logs, `tot_search_samples`);
* TRL- and verl-style records (`records_from_trl`, `records_from_verl`, read in
  :mod:`treecompile.rl.records`) and a collator that groups them by prompt into trees and
  packs them under a token budget (`RLCollator`).

An `RLSample` is a tree plus per-path advantages (and optionally old and reference
log-probs), everything aligned with the tree's paths in order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from treecompile.core.errors import TreeInputError, unknown_choice
from treecompile.rl.losses import LOSS_AGG_MODES, RLBatch, build_rl_batch
from treecompile.rl.records import RLRecord, records_from_trl, records_from_verl
from treecompile.core.tree import TrajectoryTree

__all__ = [
    "ADVANTAGE_SCALES",
    "group_advantages",
    "RLSample",
    "RLRecord",
    "grpo_group",
    "multi_turn_sample",
    "tot_search_samples",
    "records_from_trl",
    "records_from_verl",
    "RLCollator",
]

ADVANTAGE_SCALES: dict[str, str] = {
    "std": "GRPO: (r - mean) / (std + eps), std unbiased (as TRL and verl compute it)",
    "none": "Dr. GRPO: r - mean (no division by the group's std)",
}


def group_advantages(
    rewards: Sequence[float], groups: Sequence[Any] | None = None, *, scale: str = "std", eps: float = 1e-6
) -> np.ndarray:
    """``[n]`` group-normalised advantages.

    Args:
        rewards: ``[n]`` one reward per completion.
        groups: ``[n]`` group key of each completion (e.g. its prompt); None: one group.
        scale: a key of `ADVANTAGE_SCALES`.
        eps: added to the std.

    Returns:
        float64 advantages. A group of one gets 0 (its mean is its reward).
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(unknown_choice("advantage scale", scale, ADVANTAGE_SCALES))
    r = np.asarray(rewards, dtype=np.float64)
    keys = [0] * len(r) if groups is None else list(groups)
    if len(keys) != len(r):
        raise TreeInputError(f"{len(keys)} group keys for {len(r)} rewards")
    out = np.zeros_like(r)
    by_group: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        by_group.setdefault(k, []).append(i)
    for idx in by_group.values():
        g = r[idx]
        centred = g - g.mean()
        if scale == "std" and len(g) > 1:
            centred = centred / (g.std(ddof=1) + eps)
        out[idx] = centred
    return out


@dataclass
class RLSample:
    """A tree and its per-path RL inputs (see `treecompile.rl.losses.build_rl_batch`).

    Attributes:
        tree: the tree; its loss masks select the trained tokens.
        advantages: per path, a scalar or ``[T_p]``.
        old_logprobs: per path ``[T_p]`` or None.
        ref_logprobs: per path ``[T_p]`` or None.
    """

    tree: TrajectoryTree
    advantages: list[Any]
    old_logprobs: list[Any] | None = None
    ref_logprobs: list[Any] | None = None

    @property
    def num_tokens(self) -> int:
        """Rows the tree takes in a batch."""
        return self.tree.num_tokens


def grpo_group(
    prompt_ids: Sequence[int],
    completions: Sequence[Sequence[int]],
    rewards: Sequence[float] | None = None,
    *,
    advantages: Sequence[Any] | None = None,
    scale: str = "std",
    eps: float = 1e-6,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
    completion_masks: Sequence[Sequence[int] | None] | None = None,
) -> RLSample:
    """One GRPO group as a tree: the prompt once, the n completions branching off it.

    Args:
        prompt_ids: the prompt's tokens.
        completions: n completions' tokens (completions that share a beginning share tokens).
        rewards: n rewards, normalised with `group_advantages` (or give ``advantages``).
        advantages: n scalars or per-completion-token lists, used as they are.
        scale: as `group_advantages`.
        eps: as `group_advantages`.
        old_logprobs: per completion, one log-prob per completion token.
        ref_logprobs: per completion, one reference log-prob per completion token.
        completion_masks: per completion, 0/1 per token (0: not trained, e.g. a tool
            output inside a multi-turn response) or None (all trained).

    Returns:
        The `RLSample`; only completion tokens are targets.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise TreeInputError("the prompt is empty")
    n = len(completions)
    if (rewards is None) == (advantages is None):
        raise TreeInputError("give either rewards or advantages")
    adv = list(advantages) if advantages is not None else list(group_advantages(rewards, scale=scale, eps=eps))
    if len(adv) != n:
        raise TreeInputError(f"{len(adv)} rewards/advantages for {n} completions")
    seqs, masks, path_adv = [], [], []
    for i, c in enumerate(completions):
        c = [int(t) for t in c]
        seqs.append(prompt + c)
        cm = None if completion_masks is None else completion_masks[i]
        cm = [1] * len(c) if cm is None else [int(x) for x in cm]
        if len(cm) != len(c):
            raise TreeInputError(f"completion_masks[{i}] has {len(cm)} values for {len(c)} tokens")
        masks.append([0] * len(prompt) + cm)
        path_adv.append(_pad_front(adv[i], len(prompt), len(c), "advantages", i, scalar_ok=True))

    def per_path(values, name):
        if values is None:
            return None
        if len(values) != n:
            raise TreeInputError(f"{name} has {len(values)} entries for {n} completions")
        return [_pad_front(v, len(prompt), len(completions[i]), name, i, scalar_ok=False)
                for i, v in enumerate(values)]

    tree = TrajectoryTree.from_sequences(seqs, loss_masks=masks)
    return RLSample(tree, path_adv, per_path(old_logprobs, "old_logprobs"), per_path(ref_logprobs, "ref_logprobs"))


def _pad_front(v: Any, n_prompt: int, n_completion: int, name: str, i: int, *, scalar_ok: bool) -> Any:
    """Completion-aligned values to path-aligned ones (zeros over the prompt, never targets)."""
    arr = np.asarray(v.detach().cpu() if hasattr(v, "detach") else v, dtype=np.float64)
    if arr.ndim == 0:
        if not scalar_ok:
            raise TreeInputError(f"{name}[{i}] is a scalar; expected one value per completion token")
        return float(arr)
    if arr.shape != (n_completion,):
        raise TreeInputError(f"{name}[{i}] has {arr.shape[0] if arr.ndim else 0} values for {n_completion} "
                             "completion tokens")
    return np.concatenate([np.zeros(n_prompt), arr])


def multi_turn_sample(
    conversations: Sequence[Sequence[dict]],
    tokenizer: Any,
    advantages: Sequence[Any],
    **kwargs: Any,
) -> RLSample:
    """Multi-turn trajectories where every assistant turn is a sample.

    Args:
        conversations: C conversations (OpenAI-format messages).
        tokenizer: as `treecompile.chat.to_tree.tree_from_messages`.
        advantages: per conversation, a scalar (given to each of its turns) or a list with
            one scalar per assistant turn.
        **kwargs: passed to `treecompile.chat.to_tree.tree_from_messages` (``samples`` is
            ``"assistant_turns"``; ``loss_on`` defaults to ``"last_assistant"`` so that each
            turn is trained in its own sample, once).

    Returns:
        The `RLSample`: one path per assistant turn, each a prefix of the next.
    """
    from treecompile.chat.to_tree import tree_from_messages

    kwargs.setdefault("loss_on", "last_assistant")
    if len(advantages) != len(conversations):
        raise TreeInputError(f"{len(advantages)} advantages for {len(conversations)} conversations")
    tree = tree_from_messages(conversations, tokenizer, samples="assistant_turns", **kwargs)
    path_adv: list[float] = []
    for c, (conv, a) in enumerate(zip(conversations, advantages)):
        msgs = conv["messages"] if isinstance(conv, dict) else conv
        turns = sum(1 for m in msgs if m.get("role") == "assistant")
        a = np.asarray(a, dtype=np.float64)
        if a.ndim == 0:
            path_adv.extend([float(a)] * turns)
        elif a.shape == (turns,):
            path_adv.extend(float(x) for x in a)
        else:
            raise TreeInputError(f"conversation {c}: {a.shape[0]} advantages for {turns} assistant turns")
    if len(path_adv) != tree.num_paths:
        raise TreeInputError(f"the tree has {tree.num_paths} paths but the conversations have {len(path_adv)} "
                             "assistant turns")
    return RLSample(tree, path_adv)


def tot_search_samples(
    path: str | Path,
    tokenizer: Any,
    *,
    problems: Sequence[int] | None = None,
    scale: str = "std",
) -> list[RLSample]:
    """Tree-of-Thoughts search logs (game of 24) as one token tree per problem.

    Each search step expands the partial solutions it kept (``ys``) into candidates
    (``new_ys``) that a value model scores (``values``). Every candidate is a sample: the
    problem, then its lines (each line tokenized on its own, so a candidate's tokens extend
    its parent's exactly). Only the candidate's new line is a target; its advantage is its
    value normalised among its siblings (candidates expanded from the same partial solution),
    as `group_advantages` does. Kept partial solutions are internal endpoints of the tree.

    Args:
        path: the JSON file (a list of problems, each with ``steps``).
        tokenizer: anything `treecompile.chat.tokenizer.load_tokenizer` accepts.
        problems: indices of the problems to read (default all).
        scale: a key of `ADVANTAGE_SCALES`.
    """
    from treecompile.chat.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for i in problems if problems is not None else range(len(data)):
        steps = data[i]["steps"]
        prompt = tok.encode(f"Use numbers and basic arithmetic operations (+ - * /) to obtain 24.\nInput: "
                            f"{steps[0]['x']}\nSteps:\n")
        line_tokens: dict[str, list[int]] = {}

        def encode_lines(text: str) -> list[int]:
            ids: list[int] = []
            for line in text.splitlines(keepends=True):
                if line not in line_tokens:
                    line_tokens[line] = tok.encode(line)
                ids.extend(line_tokens[line])
            return ids

        seqs, masks, values, parents = [], [], [], []
        seen: set[str] = set()
        for step in steps:
            for y, v in zip(step["new_ys"], step["values"]):
                if y in seen:  # the same candidate from two parents: one sample
                    continue
                seen.add(y)
                lines = y.splitlines(keepends=True)
                head = encode_lines("".join(lines[:-1]))
                new = encode_lines(lines[-1]) if lines else []
                if not new:
                    continue
                seqs.append(prompt + head + new)
                masks.append([0] * (len(prompt) + len(head)) + [1] * len(new))
                values.append(float(v))
                parents.append("".join(lines[:-1]))
        adv = group_advantages(values, parents, scale=scale)
        tree = TrajectoryTree.from_sequences(seqs, loss_masks=masks, metadata={"source": "tot", "problem": i})
        out.append(RLSample(tree, list(adv)))
    return out


class RLCollator:
    """Groups records by prompt into trees and packs them into `RLBatch` es under a token budget.

    Records with the same prompt tokens form one GRPO group: one tree (the prompt computed
    once), advantages from the rewards normalised per group (or the records' own
    advantages). Trees are packed greedily, in order, into batches of at most
    ``max_tokens`` rows; a tree larger than the budget is refused (partition it first).

    The loss of every batch is normalised over the *whole* call (a global token or path
    count is passed as the ``denominator``), so the sum of the batches' losses equals the loss
    of one batch holding everything: gradient accumulation stays exact.

    Args:
        max_tokens: the row budget per batch.
        loss_agg_mode: a key of `treecompile.rl.losses.LOSS_AGG_MODES`.
        max_len: ``L`` for ``seq-mean-token-sum-norm``.
        scale: as `group_advantages`.
        eps: as `group_advantages`.
    """

    def __init__(self, max_tokens: int, *, loss_agg_mode: str = "token-mean", max_len: float | None = None,
                 scale: str = "std", eps: float = 1e-6) -> None:
        if loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(unknown_choice("loss aggregation mode", loss_agg_mode, LOSS_AGG_MODES))
        self.max_tokens = max_tokens
        self.loss_agg_mode = loss_agg_mode
        self.max_len = max_len
        self.scale = scale
        self.eps = eps

    def samples(self, records: Sequence[RLRecord]) -> list[RLSample]:
        """One `RLSample` per distinct prompt, in order of first appearance."""
        groups: dict[tuple[int, ...], list[RLRecord]] = {}
        for r in records:
            groups.setdefault(tuple(r.prompt_ids), []).append(r)
        out = []
        for prompt, recs in groups.items():
            has_adv = [r.advantages is not None for r in recs]
            if any(has_adv) and not all(has_adv):
                raise TreeInputError("records of one prompt must all carry advantages or all rewards")
            kwargs: dict[str, Any] = {}
            if all(has_adv):
                kwargs["advantages"] = [r.advantages for r in recs]
            else:
                if any(r.reward is None for r in recs):
                    raise TreeInputError("a record has neither a reward nor advantages")
                kwargs["rewards"] = [r.reward for r in recs]
            for key in ("old_logprobs", "ref_logprobs"):
                vals = [getattr(r, key) for r in recs]
                if any(v is None for v in vals) and not all(v is None for v in vals):
                    raise TreeInputError(f"records of one prompt must all carry {key} or none")
                kwargs[key] = None if vals[0] is None else vals
            kwargs["completion_masks"] = [r.completion_mask for r in recs]
            out.append(grpo_group(list(prompt), [r.completion_ids for r in recs], scale=self.scale, eps=self.eps,
                                  **kwargs))
        return out

    def batches(self, samples: Sequence[RLSample]) -> list[RLBatch]:
        """Packs samples into batches under the budget, with a global denominator."""
        bins: list[list[RLSample]] = []
        used = 0
        for i, s in enumerate(samples):
            if s.num_tokens > self.max_tokens:
                raise TreeInputError(f"sample {i} has {s.num_tokens} tokens, over max_tokens={self.max_tokens}; "
                                     "partition its tree first")
            if not bins or used + s.num_tokens > self.max_tokens:
                bins.append([])
                used = 0
            bins[-1].append(s)
            used += s.num_tokens
        denominator = self._global_denominator(samples)
        out = []
        for group in bins:
            def cat(key):
                vals = [getattr(s, key) for s in group]
                if all(v is None for v in vals):
                    return None
                if any(v is None for v in vals):
                    raise TreeInputError(f"{key} is given for some samples of a batch only")
                return [x for v in vals for x in v]

            out.append(build_rl_batch(
                [s.tree for s in group], advantages=cat("advantages"), old_logprobs=cat("old_logprobs"),
                ref_logprobs=cat("ref_logprobs"), loss_agg_mode=self.loss_agg_mode, max_len=self.max_len,
                denominator=denominator,
            ))
        return out

    def _global_denominator(self, samples: Sequence[RLSample]) -> float:
        if self.loss_agg_mode == "token-mean":
            from treecompile.core.loss import path_target_counts

            n = float(sum(path_target_counts(s.tree).sum() for s in samples))
            return n if n > 0 else 1.0
        return float(sum(s.tree.num_paths_with_tokens for s in samples))  # empty paths enter no mean

    def __call__(self, records: Sequence[RLRecord | dict]) -> list[RLBatch]:
        """Records (`RLRecord` or TRL-style dicts) to batches."""
        records = list(records)
        if records and isinstance(records[0], dict):
            records = records_from_trl(records)
        return self.batches(self.samples(records))

    def iter_batches(self, records: Sequence[RLRecord | dict]) -> Iterator[RLBatch]:
        """`__call__`, one batch at a time."""
        yield from self(records)
