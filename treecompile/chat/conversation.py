"""Chat conversations (OpenAI message format) rendered to token sequences and loss masks,
one per path, message by message; :mod:`treecompile.chat.messages` checks the messages first,
and :mod:`treecompile.chat.to_tree` merges the paths into a tree and describes the template.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treecompile.chat.template import TemplateRenderer, has_chat_template, message_dicts
from treecompile.core.errors import TreeInputError, unknown_choice
from treecompile.chat.messages import Message, normalize_conversation
from treecompile.chat.tokenizer import IM_END, IM_START, Tokenizer, load_tokenizer

__all__ = [
    "LOSS_ON",
    "ON_DRIFT",
    "SAMPLES",
    "TEMPLATES",
    "THINK",
    "RetokenizationDriftWarning",
    "RenderOptions",
    "RenderedPaths",
    "normalize_conversation",
    "render_conversations",
    "render_text",
]

SAMPLES = ("conversation", "assistant_turns")
THINK = ("auto", "last", "all", "none")
LOSS_ON = ("assistant", "last_assistant", "all")
ON_DRIFT = ("warn", "error", "ignore")
TEMPLATES = ("auto", "chatml", "tokenizer")

# How many drifting conversations the report describes in detail.
_MAX_DRIFT_EXAMPLES = 5


class RetokenizationDriftWarning(UserWarning):
    """Message-by-message tokens differ from tokenizing the whole rendered text."""


# ---------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class _Rendered:
    """One message's tokens, split into header | body | end marker | separator."""

    tokens: np.ndarray  # [T] int64
    sizes: tuple[int, int, int, int]  # token counts of header, body, end, separator
    texts: tuple[str, str, str, str]  # the text of each piece (markers spelled out)

    @property
    def text(self) -> str:
        return "".join(self.texts)


class _Renderer:
    """Renders and tokenizes messages, caching by (role, body): system prompts repeat a lot."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.start_id = tok.special_id(IM_START)
        self.end_id = tok.special_id(IM_END)
        self._cache: dict[tuple[str, str], _Rendered] = {}
        self._sep = tok.encode("\n")

    def render(self, msg: Message, keep_reasoning: bool) -> _Rendered:
        body = msg.body(keep_reasoning)
        key = (msg.role, body)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        header_text = f"{IM_START}{msg.role}\n"
        if self.start_id is not None:
            header = [self.start_id, *self.tok.encode(f"{msg.role}\n")]
        else:
            header = self.tok.encode(header_text)
        body_ids = self.tok.encode(body) if body else []
        end = [self.end_id] if self.end_id is not None else self.tok.encode(IM_END)
        pieces = (header, body_ids, end, self._sep)
        out = _Rendered(
            tokens=np.array([t for p in pieces for t in p], dtype=np.int64),
            sizes=tuple(len(p) for p in pieces),  # type: ignore[arg-type]
            texts=(header_text, body, IM_END, "\n"),
        )
        self._cache[key] = out
        return out


def render_text(messages: Sequence[dict[str, Any]], *, think: str = "all", normalize_tool_call_ids: bool = True) -> str:
    """The rendered text of one conversation (markers spelled out), for reading and debugging.

    ``think`` as in :func:`treecompile.chat.to_tree.tree_from_messages` for ``samples="conversation"``.
    """
    _check_option("think", think, THINK)
    msgs = normalize_conversation(messages, normalize_tool_call_ids=normalize_tool_call_ids)
    last = _last_assistant(msgs)
    keep = [_keep_reasoning(think, j, last) for j in range(len(msgs))]
    return "".join(f"{IM_START}{m.role}\n{m.body(k)}{IM_END}\n" for m, k in zip(msgs, keep))[:-1]


def _last_assistant(msgs: Sequence[Message], end: int | None = None) -> int:
    end = len(msgs) if end is None else end
    for j in range(end - 1, -1, -1):
        if msgs[j].role == "assistant":
            return j
    return -1


def _keep_reasoning(think: str, j: int, last_assistant: int) -> bool:
    return think == "all" or (think in ("last", "auto") and j == last_assistant)


@dataclass
class _Sample:
    conversation: int
    parts: list[tuple[int, _Rendered]]  # (message index, rendered message)

    def tokens_and_mask(self, msgs: Sequence[Message], loss_on: str) -> tuple[np.ndarray, np.ndarray]:
        toks, masks = [], []
        last = self.parts[-1][0]
        last_asst = _last_assistant(msgs, last + 1)
        for k, (j, r) in enumerate(self.parts):
            n_head, n_body, n_end, n_sep = r.sizes
            if k == len(self.parts) - 1:
                # The separator after a path's last message belongs to the next turn, which
                # this path does not have: the path ends with the end marker, as generated.
                n_sep = 0
            mask = np.zeros(n_head + n_body + n_end + n_sep, dtype=bool)
            if loss_on == "all":
                mask[:] = True
            elif msgs[j].role == "assistant" and (loss_on == "assistant" or j == last_asst):
                # Body and end marker are what the model generated; the header is the prompt.
                mask[n_head : n_head + n_body + n_end] = True
            toks.append(r.tokens[: mask.size])
            masks.append(mask)
        return np.concatenate(toks), np.concatenate(masks)


def _sample_ends(msgs: Sequence[Message], samples: str, c: int) -> list[int]:
    """The index of each path's last message in conversation ``c`` under ``samples``."""
    if samples == "conversation":
        return [len(msgs) - 1]
    ends = [j for j, m in enumerate(msgs) if m.role == "assistant"]
    if not ends:
        raise TreeInputError(f"conversation {c} has no assistant message; samples='assistant_turns' "
                             "makes one path per assistant message")
    return ends


def _check_option(name: str, value: Any, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ValueError(unknown_choice(name, value, map(repr, valid)))


# ---------------------------------------------------------------------------- drift


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    aa = np.asarray(a[:n], dtype=np.int64)
    bb = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(aa != bb)
    return int(diff[0]) if diff.size else n


def _drift_in(
    parts: list[tuple[int, _Rendered]], tok: Tokenizer, drop_last_sep: bool = True
) -> dict[str, Any] | None:
    """Compares piecewise tokens of ``parts`` with tokenizing their whole text at once."""
    texts = [t for _, r in parts for t in r.texts]
    sizes = [s for _, r in parts for s in r.sizes]
    owners = [j for j, r in parts for _ in r.texts]
    if drop_last_sep:
        texts, sizes, owners = texts[:-1], sizes[:-1], owners[:-1]
    piecewise = np.concatenate([r.tokens for _, r in parts])[: sum(sizes)]
    whole = tok.encode_with_specials("".join(texts))
    pos = _first_diff(piecewise, whole)
    if pos == len(piecewise) and pos == len(whole):
        return None
    # Locate the piece holding the first differing token. Drift at a piece's last token is
    # a merge across the boundary after it (the tokens before agree, so the whole text's
    # token starts where the piece's does and runs on): show both sides, "|" at the cut.
    start = 0
    for k, n in enumerate(sizes):
        if pos < start + n or k == len(sizes) - 1:
            break
        start += n
    text = "".join(texts)
    if pos == start + sizes[k] - 1 and k + 1 < len(texts):
        cut = sum(len(t) for t in texts[: k + 1])
    elif pos == start and k > 0:
        cut = sum(len(t) for t in texts[:k])
    else:
        cut = None
    if cut is None:
        excerpt = texts[k][:60]
    else:
        excerpt = text[max(cut - 30, 0) : cut] + "|" + text[cut : cut + 30]
    return {
        "message": owners[k],
        "position": pos,
        "by_message": [int(t) for t in piecewise[pos : pos + 4]],
        "whole": [int(t) for t in whole[pos : pos + 4]],
        "tokens_by_message": int(len(piecewise)),
        "tokens_whole": len(whole),
        "excerpt": excerpt,
    }


def _drift_summary(report: dict[str, Any]) -> str:
    n, k = report["conversations"], report["drifting"]
    text = f"retokenization drift ({report['tokenizer']}): {k} of {n} conversations tokenize differently as a whole"
    if k:
        ex = report["examples"][0]
        text += (
            f"; first in conversation {ex['conversation']} at token {ex['position']} "
            f"(message {ex['message']}, near {json.dumps(ex['excerpt'], ensure_ascii=False)})"
        )
    return text


# ---------------------------------------------------------------------------- the paths


@dataclass
class RenderedPaths:
    """Conversations rendered to paths (see `render_conversations`).

    Attributes:
        sequences: ``[P]`` token ids of each path.
        masks: ``[P]`` loss masks aligned with ``sequences``.
        weights: ``[P]`` path weights.
        metadata: the options, the drift report and, per path, its conversation and last message.
    """

    sequences: list[np.ndarray]
    masks: list[np.ndarray]
    weights: list[float]
    metadata: dict[str, Any]


@dataclass(frozen=True)
class RenderOptions:
    """How conversations become paths: :func:`treecompile.chat.to_tree.tree_from_messages`'s options
    of the same names, checked when built (an unknown value raises ``ValueError``)."""

    samples: str = "conversation"
    think: str = "auto"
    normalize_tool_call_ids: bool = True
    loss_on: str = "assistant"
    template: str = "auto"
    on_drift: str = "warn"
    reserialize_tool_arguments: bool = False

    def __post_init__(self) -> None:
        for name, valid in (("samples", SAMPLES), ("think", THINK), ("loss_on", LOSS_ON),
                            ("template", TEMPLATES), ("on_drift", ON_DRIFT)):
            _check_option(name, getattr(self, name), valid)


def render_conversations(
    conversations: Sequence[Sequence[dict[str, Any]]],
    tokenizer: Any,
    options: RenderOptions | None = None,
    *,
    weights: Sequence[float] | None = None,
) -> RenderedPaths:
    """Renders chat conversations to token sequences with their loss masks, one per path.

    ``options`` and ``weights`` are :func:`treecompile.chat.to_tree.tree_from_messages`'s (which
    merges the paths into a tree); None means the default :class:`RenderOptions`.
    """
    opts = options if options is not None else RenderOptions()
    samples, loss_on, on_drift = opts.samples, opts.loss_on, opts.on_drift
    think = "last" if opts.think == "auto" else opts.think
    if isinstance(conversations, dict) or isinstance(conversations, (str, bytes)):
        raise TreeInputError("conversations must be a list of conversations (each a list of messages)")
    conversations = list(conversations)
    if not conversations:
        raise TreeInputError("conversations is empty: a tree needs at least one conversation")
    if isinstance(conversations[0], dict) and "role" in conversations[0]:
        raise TreeInputError(
            "conversations must be a list of conversations, got a single conversation (a list of "
            "messages): wrap it in a list"
        )
    if weights is not None:
        weights = list(weights)
        if len(weights) != len(conversations):
            raise TreeInputError(f"weights has {len(weights)} entries for {len(conversations)} conversations")
    if opts.template == "tokenizer" or (opts.template == "auto" and has_chat_template(tokenizer)):
        return _render_with_template(conversations, tokenizer, opts, weights)
    tok = load_tokenizer(tokenizer)
    renderer = _Renderer(tok)

    seqs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    path_weights: list[float] = []
    path_conv: list[int] = []
    path_msg: list[int] = []
    examples: list[dict[str, Any]] = []
    drifting = 0
    for c, conv in enumerate(conversations):
        msgs = normalize_conversation(conv, normalize_tool_call_ids=opts.normalize_tool_call_ids, index=c)
        conv_samples = []
        for end in _sample_ends(msgs, samples, c):
            last = _last_assistant(msgs, end + 1)
            parts = [(j, renderer.render(msgs[j], _keep_reasoning(think, j, last))) for j in range(end + 1)]
            conv_samples.append(_Sample(c, parts))
        for s in conv_samples:
            t, m = s.tokens_and_mask(msgs, loss_on)
            seqs.append(t)
            masks.append(m)
            path_weights.append(1.0 if weights is None else weights[c])
            path_conv.append(c)
            path_msg.append(s.parts[-1][0])
        drift = _conversation_drift(conv_samples, tok)
        if drift is not None:
            drifting += 1
            if len(examples) < _MAX_DRIFT_EXAMPLES:
                examples.append({"conversation": c, **drift})

    report: dict[str, Any] = {
        "tokenizer": tok.name,
        "conversations": len(conversations),
        "drifting": drifting,
        "examples": examples,
    }
    report["summary"] = _drift_summary(report)
    if drifting and on_drift == "error":
        raise TreeInputError(report["summary"])
    if drifting and on_drift == "warn":
        warnings.warn(report["summary"], RetokenizationDriftWarning, stacklevel=3)
    metadata = {
        "source": "messages",
        "template": "chatml",
        "tokenizer": tok.name,
        "samples": samples,
        "think": think,
        "loss_on": loss_on,
        "normalize_tool_call_ids": opts.normalize_tool_call_ids,
        "drift": report,
        "path_conversation": path_conv,
        "path_message": path_msg,
    }
    return RenderedPaths(seqs, masks, path_weights, metadata)


def _conversation_drift(conv_samples: list[_Sample], tok: Tokenizer) -> dict[str, Any] | None:
    """Drift of one conversation: its longest sample in full, and each other sample's last
    message (with the message before it) where that rendering does not occur in the longest."""
    full = max(conv_samples, key=lambda s: len(s.parts))
    drift = _drift_in(full.parts, tok)
    if drift is not None:
        return drift
    seen = {id(r) for _, r in full.parts}
    for s in conv_samples:
        if id(s.parts[-1][1]) not in seen:
            drift = _drift_in(s.parts[-2:], tok)
            if drift is not None:
                drift["position"] = None  # a window, not a path position
                return drift
    return None


def _render_with_template(
    conversations: list, tokenizer: Any, opts: RenderOptions, weights: Sequence[float] | None
) -> RenderedPaths:
    """`render_conversations` with the tokenizer's own chat template (see
    :mod:`treecompile.chat.template`): each path is its messages rendered and tokenized
    whole. ``think="auto"`` hands every assistant message its reasoning and lets the template
    decide what it shows, as at inference."""
    renderer = TemplateRenderer(tokenizer)
    think = "all" if opts.think == "auto" else opts.think
    seqs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    path_weights: list[float] = []
    path_conv: list[int] = []
    path_msg: list[int] = []
    rerendered = 0
    for c, conv in enumerate(conversations):
        tools = conv.get("tools") if isinstance(conv, dict) else None
        msgs = normalize_conversation(conv, normalize_tool_call_ids=opts.normalize_tool_call_ids, index=c)
        previous: list[int] | None = None
        for end in _sample_ends(msgs, opts.samples, c):
            last = _last_assistant(msgs, end + 1)
            dicts = message_dicts(msgs[: end + 1], [_keep_reasoning(think, j, last) for j in range(end + 1)],
                                  reserialize_tool_arguments=opts.reserialize_tool_arguments)
            ids, marked = renderer.ids(dicts, tools, mask=True)
            mask = renderer.loss_mask(dicts, tools, ids, marked, opts.loss_on, f"conversation {c}")
            if previous is not None and ids[: len(previous)] != previous:
                rerendered += 1  # the template renders the history differently once this turn follows
            previous = ids
            seqs.append(np.asarray(ids, dtype=np.int64))
            masks.append(mask)
            path_weights.append(1.0 if weights is None else weights[c])
            path_conv.append(c)
            path_msg.append(end)
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    report: dict[str, Any] = {
        "tokenizer": name, "conversations": len(conversations), "drifting": 0, "examples": [],
        "rerendered_samples": rerendered,
        "summary": (f"rendered whole by the chat template of {name}: no message-by-message tokenization to drift; "
                    f"{rerendered} samples whose history the template renders differently from the sample before "
                    "them (they branch off it)"),
    }
    metadata = {
        "source": "messages", "template": "tokenizer", "tokenizer": name, "samples": opts.samples, "think": think,
        "loss_on": opts.loss_on, "normalize_tool_call_ids": opts.normalize_tool_call_ids, "drift": report,
        "path_conversation": path_conv, "path_message": path_msg,
    }
    return RenderedPaths(seqs, masks, path_weights, metadata)
