"""Chat conversations (OpenAI message format) to trajectory trees.

Example:
    >>> from treecompile.chat.to_tree import tree_from_messages
    >>> convs = [
    ...     [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    ...     [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four."}],
    ... ]
    >>> tree = tree_from_messages(convs, "bytes")
    >>> tree.num_paths, tree.stats().por > 0
    (2, True)

With a Hugging Face tokenizer that has a chat template (``tokenizer.chat_template``), each
path is rendered by that template (``apply_chat_template``) and tokenized whole: the tokens
the model is trained and served with, its system prompt, tool schema and reasoning rules
included (`treecompile.chat.template` says which tokens are trained). Otherwise (or with
``template="chatml"``) each message is rendered with a ChatML-like template::

    <|im_start|>{role}\\n{body}<|im_end|>\\n

and tokenized **message by message** (the header ``<|im_start|>{role}\\n``, the body, the
end marker and the newline separately), then concatenated. Identical histories therefore
give identical tokens whatever follows them, which is what lets trials and turns share a
prefix. The markers become the tokenizer's special-token ids when it has them, else they
are encoded as plain text.

Bodies:

* system / user: the content.
* assistant: ``<think>\\n{reasoning}\\n</think>\\n\\n`` when reasoning is kept (see
  ``think``), then the content, then one ``<tool_call>\\n{json}\\n</tool_call>`` per tool
  call, where ``{json}`` is ``{"name": ..., "arguments": {...}, "id": ...}`` with the
  arguments parsed from their JSON string and dumped back in their original key order.
* tool: ``<tool_response id="{tool_call_id}" name="{name}">\\n{content}\\n</tool_response>``.

Tokenizing piece by piece is only exact if it equals tokenizing the whole rendered text
(Prompt Trees' *distributivity* condition); where a BPE merge crosses a piece boundary it
does not. :func:`tree_from_messages` checks this for every conversation and reports
the drift in ``tree.metadata["drift"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treecompile.chat.conversation import (
    LOSS_ON,
    ON_DRIFT,
    SAMPLES,
    TEMPLATES,
    THINK,
    RenderOptions,
    RetokenizationDriftWarning,
    normalize_conversation,
    render_conversations,
    render_text,
)
from treecompile.core.tree import TrajectoryTree

# The option tuples and message helpers of `treecompile.chat.conversation`, re-exported beside the tree builder.
__all__ = ["LOSS_ON", "ON_DRIFT", "SAMPLES", "TEMPLATES", "THINK", "RetokenizationDriftWarning",
           "normalize_conversation", "render_text", "tree_from_messages"]


def tree_from_messages(
    conversations: Sequence[Sequence[dict[str, Any]]],
    tokenizer: Any,
    *,
    samples: str = "conversation",
    think: str = "auto",
    normalize_tool_call_ids: bool = True,
    loss_on: str = "assistant",
    template: str = "auto",
    on_drift: str = "warn",
    vocab_size: int | None = None,
    weights: Sequence[float] | None = None,
    reserialize_tool_arguments: bool = False,
) -> TrajectoryTree:
    """Renders chat conversations and merges their token sequences into one tree.

    Args:
        conversations: C conversations, each a list of OpenAI-format messages (or a dict
            with a ``"messages"`` list and optionally ``"tools"``, the tool schemas a chat
            template renders).
        tokenizer: anything :func:`treecompile.chat.tokenizer.load_tokenizer` accepts
            (``"cl100k"``, ``"sample"``, ``"bytes"``, a HF tokenizer, a callable...).
        samples: ``"conversation"``: one path per conversation. ``"assistant_turns"``:
            one path per assistant message, the conversation up to and including it
            (each a prefix of the next, as multi-turn RL samples are).
        think: which assistant turns keep their reasoning. ``"last"``: only the path's
            final assistant turn (earlier turns are rendered without it, as chat
            templates do, so each turn's sample branches off the next); ``"all"``;
            ``"none"``. ``"auto"``: ``"last"`` with ChatML; with the tokenizer's template,
            every assistant message hands it its reasoning and the template decides what
            it shows, as at inference (Qwen3's drops the reasoning of turns before the
            last user message).
        normalize_tool_call_ids: replace random tool-call ids by ``call_0``, ``call_1``, ...
            per conversation, so that trials making the same calls share tokens.
        loss_on: ``"assistant"``: the body and end marker of every assistant message;
            ``"last_assistant"``: only the path's last assistant message; ``"all"``.
        template: ``"auto"``: the tokenizer's chat template when it has one, else ChatML;
            ``"tokenizer"``: the tokenizer's chat template (an error without one);
            ``"chatml"``: the ChatML rendering above, message by message.
        on_drift: what to do when message-by-message tokens differ from tokenizing a
            conversation's whole text: ``"warn"`` (one :class:`RetokenizationDriftWarning`),
            ``"error"`` (raise :class:`TreeInputError`) or ``"ignore"``. The report is in
            ``tree.metadata["drift"]`` in every case.
        vocab_size: if given, token ids at or above it are refused.
        weights: ``[C]`` one weight per conversation, given to each of its paths.
        reserialize_tool_arguments: with the tokenizer's template, a tool call's
            ``arguments`` string goes to the template as it is (the template writes it back
            verbatim: the tokens the policy sampled); True hands it the parsed object instead,
            which templates write back with ``tojson``'s spacing. (ChatML always writes the
            parsed arguments, see above.)

    Returns:
        The tree. ``tree.metadata`` holds the options, ``"drift"`` (the report), and per
        path ``"path_conversation"`` and ``"path_message"`` (index of its last message).

    Raises:
        TreeInputError: on malformed messages, a conversation with no assistant message
            under ``samples="assistant_turns"``, or drift under ``on_drift="error"``.
        ValueError: on an unknown option value.
    """
    options = RenderOptions(samples=samples, think=think, normalize_tool_call_ids=normalize_tool_call_ids,
                            loss_on=loss_on, template=template, on_drift=on_drift,
                            reserialize_tool_arguments=reserialize_tool_arguments)
    paths = render_conversations(conversations, tokenizer, options, weights=weights)
    return TrajectoryTree.from_rendered(paths, vocab_size=vocab_size)
