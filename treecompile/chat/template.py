"""Conversations rendered by a tokenizer's own chat template (``apply_chat_template``).

A path is what the template renders for its messages, tokenized as a whole, so its tokens are
those the model is trained and served with: the template's system prompt, its tool schema, its
reasoning rules (Qwen3's drops the reasoning of turns before the last user message), its
separators. Paths of one conversation share a prefix wherever their renderings agree token by
token, and branch where they do not (a turn whose reasoning a later sample drops).

Which tokens are trained:

* a template with ``{% generation %}`` blocks marks the assistant tokens itself
  (``return_assistant_tokens_mask``): those are trained;
* otherwise each assistant message's tokens are found by rendering the history before it with
  the generation prompt: that rendering must be a prefix of the path's, and the message's
  generated tokens run from there to its end-of-turn token (the first special token the
  template writes after an assistant message's text, found by rendering a probe once per
  tokenizer) inclusive. A template whose history renders differently once later turns follow
  cannot be split so and is refused with the message it fails at.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from treecompile.core.errors import TreeInputError
from treecompile.chat.messages import Message

__all__ = ["has_chat_template", "generation_marked", "message_dicts", "TemplateRenderer"]

_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")
#: Renderings a `TemplateRenderer` keeps (a conversation's histories; cleared when full).
_MAX_RENDERS = 1024


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is a Hugging Face tokenizer with a chat template set."""
    return callable(getattr(tokenizer, "apply_chat_template", None)) and bool(getattr(tokenizer, "chat_template", None))


def generation_marked(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders
        template = template.get("default")
    return isinstance(template, str) and bool(_GENERATION.search(template))


def message_dicts(msgs: Sequence[Message], keep_reasoning: Sequence[bool], *,
                  reserialize_tool_arguments: bool = False) -> list[dict[str, Any]]:
    """Checked messages back in the OpenAI format chat templates read (tool calls as
    ``{"type": "function", "id", "function": {"name", "arguments"}}``, reasoning as
    ``reasoning_content`` where kept).

    A tool call's ``arguments`` are handed over as the conversation gives them: the string the
    model wrote is what the template writes back (templates write a string as it is and an
    object through ``tojson``, which re-spaces it), so the path holds the tokens the policy
    sampled. ``reserialize_tool_arguments``: hand the parsed object instead."""
    out = []
    for m, keep in zip(msgs, keep_reasoning):
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "assistant":
            if keep and m.reasoning:
                d["reasoning_content"] = m.reasoning
            if m.tool_calls:
                given = m.raw_arguments if len(m.raw_arguments) == len(m.tool_calls) else [None] * len(m.tool_calls)
                d["tool_calls"] = [
                    {"type": "function", **({"id": cid} if cid is not None else {}),
                     "function": {"name": name,
                                  "arguments": args if reserialize_tool_arguments or raw is None else raw}}
                    for (cid, name, args), raw in zip(m.tool_calls, given)]
        if m.role == "tool":
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
        out.append(d)
    return out


class TemplateRenderer:
    """Renders message lists with ``tokenizer.apply_chat_template`` and finds the trained tokens."""

    def __init__(self, tokenizer: Any) -> None:
        if not has_chat_template(tokenizer):
            raise TreeInputError("template='tokenizer' needs a Hugging Face tokenizer with a chat template "
                                 "(tokenizer.chat_template); without one use template='chatml'")
        self.tok = tokenizer
        self.marked = generation_marked(tokenizer)
        self._end_of_turn: int | None = None
        # Renderings by their messages: the samples of a conversation render the same
        # histories again (each assistant turn's history, for every sample holding it). A
        # renderer lives for one call (the tokenizer may change between calls).
        self._renders: dict[str, tuple[list[int], list[int] | None]] = {}

    def ids(self, messages: list[dict[str, Any]], tools: Any = None, *, generation_prompt: bool = False,
            mask: bool = False) -> tuple[list[int], list[int] | None]:
        """``(token ids, assistant mask or None)`` of ``messages`` as the template renders them."""
        key = json.dumps([messages, tools, generation_prompt, mask], sort_keys=True, default=repr)
        hit = self._renders.get(key)
        if hit is None:
            if len(self._renders) >= _MAX_RENDERS:
                self._renders.clear()
            hit = self._renders[key] = self._render(messages, tools, generation_prompt, mask)
        return hit

    def _render(self, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool,
                mask: bool) -> tuple[list[int], list[int] | None]:
        try:
            out = self.tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                               add_generation_prompt=generation_prompt,
                                               return_assistant_tokens_mask=mask and self.marked)
        except Exception as e:  # jinja's TemplateError, or the template's own raise_exception
            raise TreeInputError(f"the tokenizer's chat template failed on these messages: {e}") from None
        ids = [int(t) for t in out["input_ids"]]
        got = out.get("assistant_masks") if mask and self.marked else None
        return ids, None if got is None else [int(x) for x in got]

    def end_of_turn(self) -> int:
        """The special token the template writes after an assistant message's text (ChatML's
        ``<|im_end|>``, Llama 3's ``<|eot_id|>``), found once by rendering a probe."""
        if self._end_of_turn is None:
            probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
            before, _ = self.ids(probe[:1], generation_prompt=True)
            full, _ = self.ids(probe)
            special = set(getattr(self.tok, "all_special_ids", []) or [])
            special |= {int(i) for i, t in (getattr(self.tok, "added_tokens_decoder", {}) or {}).items()
                        if getattr(t, "special", False)}
            generated = full[len(before):] if full[:len(before)] == before else []
            ends = [t for t in generated if t in special]
            if not ends:
                raise TreeInputError("the tokenizer's chat template writes no special token after an assistant "
                                     "message, so its turns cannot be found: use a template with {% generation %} "
                                     "blocks, or loss_on='all'")
            self._end_of_turn = ends[0]
        return self._end_of_turn

    def assistant_spans(self, messages: list[dict[str, Any]], tools: Any, ids: Sequence[int],
                        which: Sequence[int], where: str) -> list[tuple[int, int]]:
        """``[start, stop)`` of the generated tokens of each message index in ``which`` inside
        ``ids`` (the rendering of ``messages``): from the end of the history's rendering with
        the generation prompt to the end-of-turn token, inclusive."""
        eot = self.end_of_turn()
        spans = []
        for j in which:
            before, _ = self.ids(messages[:j], tools, generation_prompt=True)
            if list(ids[:len(before)]) != before:
                raise TreeInputError(
                    f"{where}, message {j}: the chat template renders the history before this assistant message "
                    "differently once later messages follow (reasoning dropped from earlier turns, for one), and it "
                    "has no {% generation %} blocks to mark the assistant tokens: use a template with generation "
                    "blocks (TRL ships training versions of common templates), or samples='assistant_turns' with "
                    "loss_on='last_assistant' (each turn trained in the context it was generated in)")
            start = len(before)
            stop = next((k + 1 for k in range(start, len(ids)) if ids[k] == eot), len(ids))
            spans.append((start, stop))
        return spans

    def loss_mask(self, messages: list[dict[str, Any]], tools: Any, ids: Sequence[int], marked: list[int] | None,
                  loss_on: str, where: str) -> np.ndarray:
        """``[T]`` bool: the tokens of ``ids`` trained under ``loss_on`` (``"assistant"``,
        ``"last_assistant"``, ``"all"``)."""
        n = len(ids)
        if loss_on == "all":
            return np.ones(n, dtype=bool)
        assistants = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistants:
            return np.zeros(n, dtype=bool)
        which = assistants[-1:] if loss_on == "last_assistant" else assistants
        if marked is not None:
            mask = np.asarray(marked, dtype=bool)
            if loss_on == "last_assistant":
                # The template's marks after the history of the last assistant message.
                start = self.assistant_spans(messages, tools, ids, which, where)[0][0]
                mask[:start] = False
            return mask
        mask = np.zeros(n, dtype=bool)
        for start, stop in self.assistant_spans(messages, tools, ids, which, where):
            mask[start:stop] = True
        return mask
