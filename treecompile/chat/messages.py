"""Chat messages in the OpenAI format, checked and reduced to what a chat template renders.

:func:`normalize_conversation` validates one conversation (roles, text content, tool calls
and their results, assistant reasoning in ``reasoning_content``, ``reasoning`` or a leading
``<think>`` block) and returns one :class:`Message` per message; `treecompile.chat.conversation`
renders them to tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treecompile.core.errors import TreeInputError

__all__ = ["Message", "normalize_conversation"]

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_ROLES["function"] = "tool"  # the legacy OpenAI name of tool results


@dataclass(frozen=True)
class Message:
    """One message reduced to what the template renders."""

    role: str
    content: str
    reasoning: str | None = None
    tool_calls: tuple[tuple[str | None, str, Any], ...] = ()  # (id, name, arguments parsed from their JSON)
    tool_call_id: str | None = None
    name: str | None = None
    #: each tool call's arguments as given (the string the model wrote, or an object)
    raw_arguments: tuple[Any, ...] = ()

    def body(self, keep_reasoning: bool) -> str:
        if self.role == "tool":
            attrs = "".join(
                f' {k}="{v}"' for k, v in (("id", self.tool_call_id), ("name", self.name)) if v is not None
            )
            return f"<tool_response{attrs}>\n{self.content}\n</tool_response>"
        text = self.content
        if self.role != "assistant":
            return text
        if keep_reasoning and self.reasoning:
            text = f"<think>\n{self.reasoning.strip(chr(10))}\n</think>\n\n" + text
        for call_id, name, args in self.tool_calls:
            call: dict[str, Any] = {"name": name, "arguments": args}
            if call_id is not None:
                call["id"] = call_id
            if text and not text.endswith("\n"):
                text += "\n"
            text += "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
        return text


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TreeInputError(f"{where}: content part {i} has type {kind!r}; only text parts can be rendered")
        return "".join(parts)
    raise TreeInputError(f"{where}: content must be a string, a list of text parts or null, got {type(content).__name__}")


def _split_think(content: str) -> tuple[str, str | None]:
    """Splits a leading ``<think>...</think>`` block off ``content``."""
    stripped = content.lstrip()
    if stripped.startswith("<think>") and "</think>" in stripped:
        inner, rest = stripped[len("<think>") :].split("</think>", 1)
        return rest.lstrip("\n"), inner.strip("\n")
    return content, None


def _tool_calls(raw: Any, where: str) -> list[tuple[str | None, str, Any, Any]]:
    if not raw:
        return []
    if not isinstance(raw, list):
        raise TreeInputError(f"{where}: tool_calls must be a list, got {type(raw).__name__}")
    calls = []
    for i, call in enumerate(raw):
        if not isinstance(call, dict):
            raise TreeInputError(f"{where}: tool_calls[{i}] must be an object")
        fn = call.get("function", call)  # OpenAI nests name/arguments under "function"; tau2 does not
        name = fn.get("name")
        if not isinstance(name, str):
            raise TreeInputError(f"{where}: tool_calls[{i}] has no function name")
        given = args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # keep the model's unparsable string as it is
        calls.append((call.get("id"), name, args, given))
    return calls


def normalize_conversation(
    messages: Sequence[dict[str, Any]], *, normalize_tool_call_ids: bool = True, index: int = 0
) -> list[Message]:
    """Validates one conversation and reduces each message to what the template renders.

    Args:
        messages: OpenAI-format messages (``role``, ``content``, ``tool_calls``,
            ``tool_call_id``, ``name``; assistant reasoning in ``reasoning_content``,
            ``reasoning`` or a leading ``<think>...</think>`` in the content).
        normalize_tool_call_ids: replace tool-call ids by ``call_0``, ``call_1``, ... in
            order of first appearance, in the calls and in the tool results that answer them.
        index: the conversation's index, for error messages.

    Raises:
        TreeInputError: on an empty conversation, an unknown role or unrenderable content.
    """
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise TreeInputError(f"conversation {index}: expected a non-empty list of messages")
    ids: dict[str, str] = {}

    def new_id(old: Any) -> Any:
        if not normalize_tool_call_ids or old is None:
            return old
        return ids.setdefault(str(old), f"call_{len(ids)}")

    out = []
    for j, m in enumerate(messages):
        where = f"conversation {index}, message {j}"
        if not isinstance(m, dict):
            raise TreeInputError(f"{where}: expected a dict, got {type(m).__name__}")
        role = _ROLES.get(m.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise TreeInputError(f"{where}: unknown role {m.get('role')!r}; expected one of {sorted(_ROLES)}")
        content = _content_text(m.get("content"), where)
        reasoning = None
        calls: list[tuple[str | None, str, Any]] = []
        given: list[Any] = []
        if role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning is None:
                content, reasoning = _split_think(content)
            elif not isinstance(reasoning, str):
                raise TreeInputError(f"{where}: reasoning must be a string, got {type(reasoning).__name__}")
            parsed = _tool_calls(m.get("tool_calls"), where)
            calls = [(new_id(cid), name, args) for cid, name, args, _ in parsed]
            given = [raw for *_, raw in parsed]
        tool_call_id = new_id(m.get("tool_call_id")) if role == "tool" else None
        name = m.get("name") if role == "tool" else None
        out.append(Message(role, content, reasoning or None, tuple(calls), tool_call_id, name, tuple(given)))
    return out
