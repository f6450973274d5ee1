"""Trees from the tokenizer's own chat template (`treecompile.chat.template`), against
``apply_chat_template`` itself: Qwen3's (reasoning dropped from earlier turns), its TRL training
variant with ``{% generation %}`` blocks, Qwen2.5's default system prompt, Llama 3's headers."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

import treecompile as tc
from treecompile.core.errors import TreeInputError
from treecompile.chat.to_tree import tree_from_messages

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")  # ships the real templates (trl/chat_templates/*.jinja)

TEMPLATES = resources.files("trl") / "chat_templates"
SAMPLES = resources.files("treecompile") / "samples"
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _tokenizer(template: str):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(SAMPLES / "sample-tokenizer.json"),
                                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if template.startswith("llama3"):
        tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS, "bos_token": "<|begin_of_text|>"})
    tok.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tok


def _render(tok, messages, **kw):
    return [int(t) for t in tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"]]


def _trained(tok, path) -> str:
    return tok.decode([t for t, m in zip(path.tokens, path.loss_mask) if m])


TWO_TURNS = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning_content": "add them", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "reasoning_content": "add again", "content": "6"},
]


def test_paths_are_the_templates_rendering_and_earlier_reasoning_branches_off():
    tok = _tokenizer("qwen3")
    tree = tree_from_messages([TWO_TURNS], tok, samples="assistant_turns")
    first, second = tree.paths()
    # Each path is the template's own tokens for its messages (the default: the tokenizer has one).
    assert first.tokens.tolist() == _render(tok, TWO_TURNS[:3])
    assert second.tokens.tolist() == _render(tok, TWO_TURNS)
    assert tree.metadata["template"] == "tokenizer"
    # Qwen3 shows the first turn's reasoning while it is the last turn and drops it once a user
    # message follows: the second sample branches off the first inside that turn.
    assert "<think>\nadd them" in tok.decode(first.tokens) and "add them" not in tok.decode(second.tokens)
    assert _trained(tok, first) == "<think>\nadd them\n</think>\n\n4<|im_end|>"
    assert _trained(tok, second) == "4<|im_end|><think>\nadd again\n</think>\n\n6<|im_end|>"
    shared = tree.num_tokens < len(first.tokens) + len(second.tokens)
    assert shared and tree.metadata["drift"]["rerendered_samples"] == 1


def test_generation_blocks_mark_the_trained_tokens():
    tok = _tokenizer("qwen3_training")
    [path] = tree_from_messages([TWO_TURNS], tok).paths()
    full = tok.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert path.tokens.tolist() == list(full["input_ids"])
    assert path.loss_mask.astype(int).tolist() == list(full["assistant_masks"])
    [last] = tree_from_messages([TWO_TURNS], tok, loss_on="last_assistant").paths()
    assert _trained(tok, last).startswith("<think>\nadd again") and "4<|im_end|>" not in _trained(tok, last)


def test_default_system_prompt_and_llama3_headers():
    tok = _tokenizer("qwen2_5")
    conv = TWO_TURNS[1:3]
    [path] = tree_from_messages([conv], tok).paths()
    assert tok.decode(path.tokens).startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud")
    assert path.tokens.tolist() == _render(tok, conv)
    tok = _tokenizer("llama3")
    [path] = tree_from_messages([TWO_TURNS], tok).paths()
    assert path.tokens.tolist() == _render(tok, TWO_TURNS)
    assert _trained(tok, path) == "4<|eot_id|>6<|eot_id|>"  # the headers are the prompt; end of turn trained


def test_tools_from_the_conversation_reach_the_template():
    tok = _tokenizer("qwen3")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    conv = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "x9", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "x9", "content": "4"},
            {"role": "assistant", "content": "It is 4."}]
    [path] = tree_from_messages([{"messages": conv, "tools": tools}], tok).paths()
    text = tok.decode(path.tokens)
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text  # the schema, in the system turn
    trained = _trained(tok, path)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>' in trained
    assert "<tool_response>" not in trained and trained.endswith("It is 4.<|im_end|>")


def test_template_options_and_refusals():
    tok = _tokenizer("qwen3")
    chatml = tree_from_messages([TWO_TURNS], tok, template="chatml", on_drift="ignore")
    assert chatml.metadata["template"] == "chatml"
    with pytest.raises(TreeInputError, match="needs a Hugging Face tokenizer with a chat template"):
        tree_from_messages([TWO_TURNS], "bytes", template="tokenizer")
    with pytest.raises(ValueError, match="unknown template 'jinja'; valid: "):
        tree_from_messages([TWO_TURNS], tok, template="jinja")
    # A tool loop inside an earlier user turn: its reasoning shows while that turn is the last
    # and is dropped once the next user message follows, and qwen3.jinja marks no assistant
    # tokens: the conversation cannot be split into turns, and the message is named.
    loop = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "reasoning_content": "use the tool", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "reasoning_content": "done", "content": "4"},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "You are welcome."}]
    with pytest.raises(TreeInputError, match="conversation 0, message 3: the chat template renders the history"):
        tree_from_messages([loop], tok)
    # Each turn in the context it was generated in is exact.
    tree = tree_from_messages([loop], tok, samples="assistant_turns", loss_on="last_assistant")
    assert [p.tokens.tolist() for p in tree.paths()] == [_render(tok, loop[: j + 1]) for j in (1, 3, 5)]
    assert [_trained(tok, p).endswith("<|im_end|>") for p in tree.paths()] == [True] * 3


def test_real_trajectories_render_as_the_template_does():
    tok = _tokenizer("qwen3")
    convs = [json.loads(line) for line in (SAMPLES / "tau2_airline_think_sample.jsonl").read_text().splitlines()]
    tree = tc.TrajectoryTree.from_messages(convs, tok, samples="assistant_turns", loss_on="last_assistant")
    ends = tree.metadata["path_message"]
    from treecompile.chat.template import message_dicts
    from treecompile.chat.messages import normalize_conversation

    for path, c, end in zip(tree.paths(), tree.metadata["path_conversation"], ends):
        msgs = normalize_conversation(convs[c])[: end + 1]
        want = _render(tok, message_dicts(msgs, [True] * len(msgs)))
        assert path.tokens.tolist() == want
        assert 0 < int(np.sum(path.loss_mask)) < len(want)
    assert tree.stats().por > 0.5  # the turns of each trajectory share their history


def test_records_from_trl_does_not_train_tool_turns_without_generation_blocks():
    from treecompile.rl.data import records_from_trl

    tok = _tokenizer("qwen3")
    prompt = [{"role": "user", "content": "2+2?"}]
    completion = [{"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
                  {"role": "tool", "content": "4"},
                  {"role": "assistant", "content": "It is 4."}]
    [rec] = records_from_trl([{"prompt": prompt, "completion": completion}], tok, on_drift="error")
    trained = tok.decode([t for t, m in zip(rec.completion_ids, rec.completion_mask) if m])
    context = tok.decode([t for t, m in zip(rec.completion_ids, rec.completion_mask) if not m])
    assert "<tool_response>\n4\n</tool_response>" in context and "tool_response" not in trained
    assert trained.startswith("<tool_call>") and trained.endswith("It is 4.<|im_end|>")


@pytest.mark.full
def test_a_tokenizer_folder_with_a_template_renders_chats_by_it_on_the_command_line(tmp_path):
    """``treecompile stats --tokenizer DIR`` on chats: a saved Hugging Face tokenizer with a chat
    template renders them by that template, as training does (the same trees as
    ``tree_from_messages`` with the tokenizer), not by ChatML."""
    import json
    import subprocess
    import sys

    from treecompile.data.io import load_conversations
    from treecompile.data.samples import sample_path

    tok = _tokenizer("qwen2_5")
    folder = tmp_path / "tok"
    tok.save_pretrained(folder)
    cmd = [sys.executable, "-m", "treecompile", "stats", "sample:think", "--json", "--group-by", "all"]
    with_template = json.loads(subprocess.run([*cmd, "--tokenizer", str(folder)], capture_output=True,
                                              check=True).stdout)["total"]
    chatml = json.loads(subprocess.run([*cmd, "--tokenizer", str(folder / "tokenizer.json")], capture_output=True,
                                       check=True).stdout)["total"]
    convs = [r.messages for r in load_conversations(sample_path("think"))]
    direct = tree_from_messages(convs, tok, samples="conversation", think="last").stats()
    assert with_template["tree_tokens"] == direct.tree_tokens and with_template["path_tokens"] == direct.path_tokens
    assert chatml["path_tokens"] != with_template["path_tokens"]


def test_tool_call_arguments_are_the_strings_the_model_wrote():
    """Real tau-bench tool-calling logs through a chat template: each path's tokens equal
    ``apply_chat_template`` of the raw messages (the tool calls' ``arguments`` strings written back
    as given; 2 of 16 matched when they went through ``json.loads`` and ``tojson``).
    ``reserialize_tool_arguments=True`` keeps the old, re-spaced rendering as an option."""
    from treecompile.data import datasets
    from treecompile.data.samples import sample_path

    tok = _tokenizer("qwen2_5")
    convs = [c for group in datasets.load_tau_bench(sample_path("tau_bench")).values() for c in group]
    assert len(convs) == 16 and sum(any(m.get("tool_calls") for m in c) for c in convs) > 8
    differ = 0
    for c in convs:
        raw = _render(tok, c)
        assert [int(t) for t in tree_from_messages([c], tok, normalize_tool_call_ids=False,
                                                   on_drift="ignore").paths()[0].tokens] == raw
        again = tree_from_messages([c], tok, normalize_tool_call_ids=False, on_drift="ignore",
                                   reserialize_tool_arguments=True)
        differ += [int(t) for t in again.paths()[0].tokens] != raw
    assert differ > 0
