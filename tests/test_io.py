"""JSONL files of sequences, conversations and trees: round trips, grouping, kind detection, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from treecompile import TrajectoryTree, TreeInputError
from treecompile.chat.to_tree import tree_from_messages
from treecompile.data.samples import sample_conversations, sample_path
from treecompile.data.io import (
    UNGROUPED,
    ConversationRecord,
    SequenceRecord,
    detect_kind,
    load_conversations,
    load_sequences,
    load_trees,
    save_conversations,
    save_sequences,
    save_trees,
    trees_from_sequences,
)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def assert_same_tree(a: TrajectoryTree, b: TrajectoryTree) -> None:
    assert a.num_paths == b.num_paths
    for p in range(a.num_paths):
        pa, pb = a.path(p), b.path(p)
        assert np.array_equal(pa.tokens, pb.tokens), f"path {p}: tokens differ"
        assert np.array_equal(pa.loss_mask, pb.loss_mask), f"path {p}: loss masks differ"
        assert pa.weight == pb.weight, f"path {p}: weight {pa.weight} != {pb.weight}"
    assert np.array_equal(a.parent, b.parent) and np.array_equal(a.node_offsets, b.node_offsets)
    assert a.metadata == b.metadata


RECORDS = [
    SequenceRecord([5, 6, 7], group="a"),
    SequenceRecord([5, 6, 8, 9], weight=0.25, loss_mask=[0, 0, 1, 1], group="a"),
    SequenceRecord([1, 2], group="b"),
    SequenceRecord([3]),
]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"], ids=["plain", "gzip"])
def test_sequences_round_trip(tmp_path, suffix):
    path = tmp_path / f"seqs{suffix}"
    assert save_sequences(path, RECORDS) == 4
    assert load_sequences(path) == RECORDS
    assert detect_kind(path) == "sequences"


def test_sequences_file_layout_is_minimal(tmp_path):
    path = tmp_path / "seqs.jsonl"
    save_sequences(path, [RECORDS[0], {"input_ids": [1], "weight": 2.0}])
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == [{"input_ids": [5, 6, 7], "group": "a"}, {"input_ids": [1], "weight": 2.0}]


def test_groups_form_trees():
    trees = trees_from_sequences(RECORDS)
    assert list(trees) == ["a", "b", UNGROUPED]
    a = trees["a"]
    assert a.num_paths == 2 and a.num_tokens == 5  # [5, 6] shared, then [7] and [8, 9]
    assert a.path(1).weight == 0.25 and a.path(1).loss_mask.tolist() == [False, False, True, True]


def test_sequence_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [1]}\n\n{"input_ids": [1, 2], "loss_mask": [1]}\n')
    with pytest.raises(TreeInputError, match=r"bad.jsonl:3: 'loss_mask' must be a list as long as 'input_ids' \(2\)"):
        load_sequences(path)
    path.write_text('{"input_ids": [1]}\n{"input_ids": [1\n')
    with pytest.raises(TreeInputError, match=r"bad.jsonl:2: not valid JSON"):
        load_sequences(path)
    path.write_text('{"tokens": [1]}\n')
    with pytest.raises(TreeInputError, match=r"bad.jsonl:1: expected an 'input_ids' list"):
        load_sequences(path)


def test_conversations_round_trip(tmp_path):
    convs = sample_conversations()
    records = [ConversationRecord(c, group="48", weight=1.0 + i, extra={"trial": i}) for i, c in enumerate(convs)]
    path = tmp_path / "convs.jsonl"
    save_conversations(path, records)
    assert load_conversations(path) == records
    assert detect_kind(path) == "conversations"
    save_conversations(path, convs)  # bare message lists
    assert [r.messages for r in load_conversations(path)] == convs


def test_trees_round_trip(tmp_path):
    message_tree = tree_from_messages(
        sample_conversations(), "sample", samples="assistant_turns", loss_on="last_assistant"
    )
    assert message_tree.mask_exceptions  # the round trip must carry them
    sequence_tree = trees_from_sequences(RECORDS)["a"]
    path = tmp_path / "trees.jsonl"
    assert save_trees(path, [message_tree, sequence_tree]) == 2
    assert detect_kind(path) == "trees"
    back = load_trees(path)
    assert len(back) == 2
    assert_same_tree(back[0], message_tree)
    assert_same_tree(back[1], sequence_tree)


def test_single_tree_json_document(tmp_path):
    tree = trees_from_sequences(RECORDS)["a"]
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(tree.to_dict(), indent=2))
    assert detect_kind(path) == "trees"
    assert_same_tree(load_trees(path)[0], tree)


def test_bad_tree_line_names_the_line(tmp_path):
    path = tmp_path / "trees.jsonl"
    path.write_text('{"format": "treecompile.core.tree/1", "nodes": [{"parent": -1}], "paths": []}\n')
    with pytest.raises(TreeInputError, match=r"trees.jsonl:1: malformed tree"):
        load_trees(path)


def test_detect_bundled_and_shared_files():
    assert detect_kind(sample_path("tau_bench")) == "tau_bench"
    assert detect_kind(sample_path("gsm8k")) == "conversations"
    assert detect_kind(sample_path("think")) == "conversations"
    if not SHARED.exists():
        pytest.skip(f"shared data {SHARED} is absent")
    assert detect_kind(SHARED / "tau_bench" / "gpt-4o-airline-even-tasks.json") == "tau_bench"
    assert detect_kind(SHARED / "tau2" / "tau2fork_blakeelias_grok-4-fast_airline.json") == "tau2"
    assert detect_kind(SHARED / "gsm8k_example_model_solutions.jsonl") == "gsm8k"


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "the file is empty"),
        ('{"text": "hi"}\n', "cannot tell the kind"),
        ('[1, 2,\n', "neither JSON nor JSONL"),
        ('{"a": 1}', "cannot tell the kind"),
        ('[{"a": 1}]', "neither a tau-bench"),
    ],
    ids=["empty", "unknown-keys", "broken-json", "one-object", "other-list"],
)
def test_detect_kind_errors(tmp_path, content, message):
    path = tmp_path / "f.jsonl"
    path.write_text(content)
    with pytest.raises(TreeInputError, match=message):
        detect_kind(path)


def test_hugging_face_labels_and_attention_mask_in_a_sequences_line(tmp_path):
    """``labels`` -100 marks a token not trained (the loss mask); ``attention_mask`` 0 at the
    ends is padding, dropped; labels that are neither -100 nor the token, 0s between tokens, and
    labels that disagree with a loss_mask are refused naming the line."""
    from treecompile.core.errors import TreeInputError
    from treecompile.data.io import load_sequences

    good = tmp_path / "hf.jsonl"
    good.write_text('{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}\n'
                    '{"input_ids": [0, 1, 2, 5, 0], "labels": [-100, -100, 2, 5, -100], "attention_mask": [0, 1, 1, 1, 0]}\n')
    recs = load_sequences(good)
    assert [r.input_ids for r in recs] == [[1, 2, 3, 4], [1, 2, 5]]
    assert [r.loss_mask for r in recs] == [[0, 0, 1, 1], [0, 1, 1]]
    for line, message in [
        ('{"input_ids": [1, 2, 3], "labels": [-100, 3, 4]}', r"labels\[1\] = 3 is neither input_ids\[1\] = 2 nor -100"),
        ('{"input_ids": [1, 2, 3], "attention_mask": [1, 0, 1]}', "the attention mask has a hole"),
        ('{"input_ids": [1, 2, 3], "labels": [-100, 2]}', "2 labels for 3 input_ids"),
        ('{"input_ids": [0, 1, 2], "labels": [0, -100, 2], "attention_mask": [0, 1, 1]}',
         r"labels\[0\] = 0 trains a padding token"),
        ('{"input_ids": [1, 2, 3], "attention_mask": [1, 2, 1]}', "attention_mask holds 2"),
        ('{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "loss_mask": [0, 0, 1]}', "'labels' and 'loss_mask' disagree"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(line + "\n")
        with pytest.raises(TreeInputError, match=f"{bad}:1: " + message):
            load_sequences(bad)


def test_a_conversation_line_with_token_level_keys_is_refused(tmp_path):
    from treecompile.data.io import load_conversations

    bad = tmp_path / "c.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "labels": [1, -100]}) + "\n")
    with pytest.raises(TreeInputError, match=f"{bad}:1: a conversation line with 'labels': it would not be read"):
        load_conversations(bad)
