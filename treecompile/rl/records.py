"""TRL- and verl-style RL data read into `RLRecord` s, one per completion, padding and masks
honoured: what :class:`treecompile.rl.data.RLCollator` groups by prompt into trees.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from treecompile.chat.template import TemplateRenderer, has_chat_template
from treecompile.core.errors import TreeInputError, unknown_choice

__all__ = ["RLRecord", "records_from_trl", "records_from_verl"]


@dataclass
class RLRecord:
    """One completion in the collator's input format (what TRL/verl records are read into).

    Attributes:
        prompt_ids: the prompt's tokens.
        completion_ids: the completion's tokens.
        reward: a scalar reward (normalised per prompt by the collator) or None.
        advantages: a scalar or per-completion-token advantages, used as they are; or None.
        old_logprobs, ref_logprobs: per completion token, or None.
        completion_mask: per completion token 0/1 (which are trained), or None (all).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float | None = None
    advantages: Any = None
    old_logprobs: Any = None
    ref_logprobs: Any = None
    completion_mask: Any = None


def records_from_trl(
    rows: Iterable[dict] | dict | Any,
    tokenizer: Any = None,
    *,
    on_drift: str = "warn",
) -> list[RLRecord]:
    """TRL-style data as records, padding and masks honoured.

    ``rows`` is any of:

    * dicts with token ids: ``prompt_ids``, ``completion_ids``, optionally ``prompt_mask``
      and ``completion_mask`` (TRL's padded layout: a prompt's padding, where its mask is 0,
      is dropped; a completion runs to its last token with mask 1, and its 0s inside, such as a
      ``tool_mask``'s tool outputs, stay as context but are not trained), ``reward`` (or
      ``rewards``, summed), ``advantages`` (a scalar or per completion token),
      ``old_per_token_logps`` and ``ref_per_token_logps`` (per completion token);
    * dicts with text, TRL's dataset formats: ``prompt`` and ``completion`` as strings, or as
      lists of chat messages (conversational), rendered with ``tokenizer`` (a Hugging Face
      tokenizer): text by encoding the prompt and prompt + completion, chats with the
      tokenizer's own ``apply_chat_template``, whose assistant-token mask (the template's
      ``{% generation %}`` blocks, where it has them) selects the trained completion tokens;
    * TRL's batch: one dict of ``[B, ...]`` tensors (``GRPOTrainer``'s generation output);
    * a ``datasets.Dataset`` (or any iterable) of such rows.

    Drift check (text and chats): the prompt rendered alone must be a prefix of the prompt and
    completion rendered together; where it is not, the record's prompt is the longest common
    prefix (so the trained tokens are those of the full rendering) and ``on_drift`` says what
    happens: ``"warn"`` (one `treecompile.chat.to_tree.RetokenizationDriftWarning`), ``"error"``
    (`TreeInputError`) or ``"ignore"``.

    Returns:
        One `RLRecord` per row; the caller's data is not modified.
    """
    if on_drift not in ("warn", "error", "ignore"):
        raise ValueError(unknown_choice("on_drift", on_drift, ("warn", "error", "ignore")))
    if isinstance(rows, dict):
        rows = _split_trl_batch(rows)
    out, drifted = [], []
    # One renderer for every chat record: its end-of-turn probe and shared histories render once.
    renderer = TemplateRenderer(tokenizer) if has_chat_template(tokenizer) else None
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TreeInputError(f"record {i}: expected a dict, got {type(r).__name__}")
        if "prompt_ids" in r and "completion_ids" in r:
            prompt, completion, mask, keep = _trl_token_record(r, i)
        elif "prompt" in r and "completion" in r:
            prompt, completion, mask, drift = _trl_text_record(r, i, tokenizer, renderer)
            keep = slice(0, len(completion))
            if drift is not None:
                drifted.append(drift)
                if on_drift == "error":
                    raise TreeInputError(drift)
        else:
            raise TreeInputError(f"record {i}: a TRL record needs prompt_ids and completion_ids, or prompt and "
                                 f"completion (text or chat messages); it has {sorted(r)}")
        reward = r.get("reward", r.get("rewards"))

        def per_token(key, scalar_ok=False):
            v = r.get(key)
            if v is None:
                return None
            arr = np.asarray(v.detach().cpu() if hasattr(v, "detach") else v, dtype=np.float64)
            if arr.ndim == 0 and scalar_ok:
                return float(arr)
            return arr[keep].copy()

        out.append(RLRecord(
            prompt_ids=prompt,
            completion_ids=completion,
            reward=None if reward is None else float(np.asarray(
                reward.detach().cpu() if hasattr(reward, "detach") else reward, dtype=np.float64).sum()),
            advantages=per_token("advantages", scalar_ok=True),
            old_logprobs=per_token("old_per_token_logps"),
            ref_logprobs=per_token("ref_per_token_logps"),
            completion_mask=mask,
        ))
    if drifted and on_drift == "warn":
        import warnings

        from treecompile.chat.to_tree import RetokenizationDriftWarning

        warnings.warn(f"{len(drifted)} of {len(out)} records drift; first: {drifted[0]}", RetokenizationDriftWarning,
                      stacklevel=2)
    return out


def _as_int_list(v: Any) -> list[int]:
    arr = np.asarray(v.detach().cpu() if hasattr(v, "detach") else v)
    return [int(t) for t in arr.reshape(-1)]


def _split_trl_batch(batch: dict) -> list[dict]:
    """TRL's batch dict of ``[B, ...]`` tensors into per-row dicts (scalars per row kept)."""
    if "prompt_ids" not in batch or "completion_ids" not in batch:
        raise TreeInputError("a TRL batch needs prompt_ids and completion_ids")
    b = len(batch["prompt_ids"])
    rows: list[dict] = [{} for _ in range(b)]
    for key, v in batch.items():
        if v is None or isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or len(v) != b:
            continue
        for i in range(b):
            rows[i][key] = v[i]
    return rows


def _trl_token_record(r: dict, i: int) -> tuple[list[int], list[int], list[int] | None, slice]:
    prompt = np.asarray(_as_int_list(r["prompt_ids"]), dtype=np.int64)
    completion = np.asarray(_as_int_list(r["completion_ids"]), dtype=np.int64)
    if r.get("prompt_mask") is not None:
        pm = np.asarray(_as_int_list(r["prompt_mask"]))
        if pm.shape != prompt.shape:
            raise TreeInputError(f"record {i}: prompt_mask has {pm.size} values for {prompt.size} prompt tokens")
        prompt = prompt[pm.astype(bool)]
    mask = None
    n = completion.size
    if r.get("completion_mask") is not None:
        cm = np.asarray(_as_int_list(r["completion_mask"]))
        if cm.shape != completion.shape:
            raise TreeInputError(f"record {i}: completion_mask has {cm.size} values for {completion.size} tokens")
        tool = r.get("tool_mask")
        if tool is not None:
            tm = np.asarray(_as_int_list(tool))
            if tm.shape != completion.shape:
                raise TreeInputError(f"record {i}: tool_mask has {tm.size} values for {completion.size} tokens")
        else:
            tm = np.ones_like(cm)
        # The completion runs to its last real token; padding after it is dropped.
        n = int(np.flatnonzero(cm)[-1]) + 1 if cm.any() else 0
        mask = (cm[:n] * tm[:n]).astype(np.int64).tolist()
    if prompt.size == 0:
        raise TreeInputError(f"record {i}: the prompt is empty (after dropping its padding)")
    return prompt.tolist(), completion[:n].tolist(), mask, slice(0, n)


def _render_trl(tokenizer: Any, renderer: TemplateRenderer | None, prompt: Any, completion: Any,
                i: int) -> tuple[list[int], list[int], list[int] | None]:
    """(prompt ids, full ids, assistant mask of the full ids or None) of one text or chat record
    (chats through ``renderer``, the tokenizer's chat template; None without one)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return (list(tokenizer(prompt, add_special_tokens=False)["input_ids"]),
                list(tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]), None)
    if isinstance(prompt, list) and isinstance(completion, list):
        if renderer is None:
            raise TreeInputError(f"record {i} is a chat: the tokenizer needs a chat template (apply_chat_template)")
        messages = list(prompt) + list(completion)
        p_ids, _ = renderer.ids(list(prompt), generation_prompt=True)
        ids, mask = renderer.ids(messages, mask=True)
        if mask is not None and not any(mask):
            mask = None  # generation blocks that mark nothing in this record
        if mask is None and any(m.get("role") != "assistant" for m in completion):
            # Tool results or user turns inside the completion are context, not trained: the
            # assistant messages' tokens are found from the template's renderings of the history.
            mask = renderer.loss_mask(messages, None, ids, None, "assistant", f"record {i}").astype(int).tolist()
        # Otherwise every completion token is trained (a completion of assistant text alone), as TRL does.
        return list(p_ids), list(ids), mask
    raise TreeInputError(f"record {i}: prompt and completion must both be strings or both lists of messages")


def _trl_text_record(r: dict, i: int, tokenizer: Any,
                     renderer: TemplateRenderer | None) -> tuple[list[int], list[int], list[int] | None, str | None]:
    if tokenizer is None:
        raise TreeInputError(f"record {i} holds text: pass the tokenizer that renders it (records_from_trl(rows, tok))")
    p_ids, full, amask = _render_trl(tokenizer, renderer, r["prompt"], r["completion"], i)
    k = 0
    while k < min(len(p_ids), len(full)) and p_ids[k] == full[k]:
        k += 1
    drift = None
    if k < len(p_ids):
        drift = (f"record {i}: the prompt rendered alone differs from its rendering with the completion at token {k} "
                 f"({p_ids[k]} alone, {full[k] if k < len(full) else 'end'} together); the common prefix is the prompt")
    if k == 0:
        raise TreeInputError(f"record {i}: the prompt and the full rendering share no token")
    completion = full[k:]
    mask = None if amask is None else amask[k:]
    return full[:k], completion, mask, drift


def records_from_verl(batch: dict) -> list[RLRecord]:
    """A verl-style batch dict of ``[B, ...]`` arrays into records.

    Keys: ``prompts`` ``[B, Tp]`` (left-padded), ``responses`` ``[B, Tr]`` (right-padded),
    ``attention_mask`` ``[B, Tp + Tr]`` (which prompt and response tokens are real) and/or
    ``response_mask`` ``[B, Tr]``; rewards as ``token_level_rewards`` ``[B, Tr]`` (summed per
    response, as verl's outcome advantage estimators do) or ready ``advantages`` ``[B, Tr]``;
    optionally ``old_log_probs`` and ``ref_log_prob`` ``[B, Tr]``.
    """
    def arr(key):
        v = batch.get(key)
        if v is None:
            return None
        return np.asarray(v.detach().cpu() if hasattr(v, "detach") else v)

    prompts, responses = arr("prompts"), arr("responses")
    if prompts is None or responses is None:
        raise TreeInputError("a verl batch needs 'prompts' and 'responses'")
    b, tp = prompts.shape
    attn = arr("attention_mask")
    resp_mask = arr("response_mask")
    if resp_mask is None:
        if attn is None:
            raise TreeInputError("a verl batch needs 'response_mask' or 'attention_mask'")
        resp_mask = attn[:, tp:]
    prompt_mask = attn[:, :tp] if attn is not None else np.ones_like(prompts)
    rewards, adv = arr("token_level_rewards"), arr("advantages")
    old, ref = arr("old_log_probs"), arr("ref_log_prob")
    out = []
    for i in range(b):
        pm, rm = prompt_mask[i].astype(bool), resp_mask[i].astype(bool)
        # The response runs to its last real token; tokens with mask 0 inside it (tool outputs
        # in verl's multi-turn rollouts) stay in the sequence as context but are not trained.
        n = int(np.flatnonzero(rm)[-1]) + 1 if rm.any() else 0
        sel = slice(0, n)
        out.append(RLRecord(
            prompt_ids=prompts[i][pm].astype(np.int64).tolist(),
            completion_ids=responses[i][sel].astype(np.int64).tolist(),
            reward=None if rewards is None else float((rewards[i] * rm).sum()),
            advantages=None if adv is None else adv[i][sel].astype(np.float64),
            old_logprobs=None if old is None else old[i][sel].astype(np.float64),
            ref_logprobs=None if ref is None else ref[i][sel].astype(np.float64),
            completion_mask=rm[sel].astype(np.int64).tolist(),
        ))
    return out
