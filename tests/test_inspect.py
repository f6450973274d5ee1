"""`treecompile inspect`: HF configs and module:factory models, per-pass records, JSON, PNG, refusals.

The command runs in-process through `treecompile.cli.main.main`. The outputs pasted in
docs/passes.md are checked here against the real output, in their essentials (the
per-pass headers and counts, the rewrite table and the mask picture), so the page cannot
drift from what the command prints.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from treecompile.cli.main import main
from treecompile.compile.inspection import EXAMPLE_SEQUENCES, example_trees
from treecompile.compile.maskview import mask_matrix, mask_picture, png_bytes
from treecompile.passes.pipeline import PASSES

ROOT = Path(__file__).resolve().parents[1]
PASSES_PAGE = ROOT / "docs" / "passes.md"
PASS_NAMES = [p.__name__ for p in PASSES]
EXAMPLE_ROWS = 19  # tokens of EXAMPLE_SEQUENCES once merged into trees

QWEN3 = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def qwen3_config(directory: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    transformers.Qwen3Config(**QWEN3).save_pretrained(directory)
    return directory


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# A user's module beside them: a GPT with manual attention over a causal ``tril`` buffer and
# learned positions ``wpe(arange(T))``, written to the working directory by the test.
USER_MODULE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, heads, block):
        super().__init__()
        self.heads, self.ln, self.qkv, self.o = heads, nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("causal", torch.tril(torch.ones(block, block)))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln(x)).split(c, -1))
        att = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
        att = att.masked_fill(self.causal[:t, :t] == 0, float("-inf")).softmax(-1)
        return x + self.o((att @ v).transpose(1, 2).reshape(b, t, c))


class TinyGPT(nn.Module):
    def __init__(self, vocab=40, dim=16, heads=2, layers=3, block=32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads, block) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.blocks(self.wte(idx) + self.wpe(pos)))


def make_gpt():
    return TinyGPT()


def make_not_a_module():
    return 42


class Branchy(nn.Module):
    """Python control flow on a tensor value: Dynamo cannot capture it as one graph."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(40, 8), nn.Linear(8, 40)

    def forward(self, idx):
        x = self.emb(idx)
        if x.sum().item() > 0:
            x = x * 2
        return self.head(x)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``user_lm`` in a fresh working directory (not on sys.path before the command)."""
    (tmp_path / "user_lm.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command adds the cwd; undo it after
    yield "user_lm"
    sys.modules.pop("user_lm", None)


# ---------------------------------------------------------------------------- HF configs


def test_qwen3_config_file_json_and_png(tmp_path, capsys):
    config = qwen3_config(tmp_path / "qwen3") / "config.json"
    png = tmp_path / "mask.png"
    code, out, _ = run(capsys, str(config), "--json", "--png", str(png), "--png-cell", "5")
    assert code == 0
    data = json.loads(out)
    assert data["source"] == "hf-config" and data["model"].startswith("Qwen3ForCausalLM")
    assert not data["refused"] and data["refusal"] is None
    assert [p["name"] for p in data["passes"]] == PASS_NAMES
    counters = data["counters"]
    assert counters["rewrite_attention_pass"] == {"hf_interface": QWEN3["num_hidden_layers"]}
    assert counters["rewrite_positions_pass"] == {"position_ids_input": 1}
    assert counters["gather_logits_pass"] == {"gather_before_lm_head": 1}
    assert counters["verify_graph_pass"]["nodes_checked"] > 0
    # Each pass receives the graph the previous one left; sizes add up end to end.
    passes = data["passes"]
    assert data["captured"]["nodes"] == passes[0]["nodes_before"]
    for a, b in zip(passes, passes[1:]):
        assert a["nodes_after"] == b["nodes_before"], (a["name"], b["name"])
    assert data["rewritten"]["nodes"] == passes[-1]["nodes_after"]
    assert passes[0]["changed"] and not passes[-1]["changed"]  # attention rewritten; verify only checks
    assert "code_before" not in passes[0]  # whole graphs only with --full
    # The example and its mask, as lists.
    ex = data["example"]
    assert ex["tokens"] == EXAMPLE_ROWS and ex["trees"] == 2 and ex["paths"] == 6
    rows = data["attention_mask"]["rows"]
    assert len(rows) == EXAMPLE_ROWS and all(len(r) == EXAMPLE_ROWS for r in rows)
    sub = ex["subtree_end"]
    assert rows == [[int(k <= q < sub[k]) for k in range(EXAMPLE_ROWS)] for q in range(EXAMPLE_ROWS)]
    # The PNG: the labelled figure (tests/test_plots.py checks its axes and legend), at least
    # --png-cell pixels a row.
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", blob[8:16])
    width, height = struct.unpack(">II", blob[16:24])
    assert (length, kind) == (13, b"IHDR") and width > height >= 5 * EXAMPLE_ROWS
    assert data["png"] == str(png)


def test_qwen3_config_directory_text_matches_the_docs(tmp_path, capsys, monkeypatch):
    qwen3_config(tmp_path / "qwen3-tiny")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "qwen3-tiny")
    assert code == 0
    assert "+++ after rewrite_attention_pass" in out  # a unified diff per changed pass
    assert "-    out = torch.ops.treecompile.causal_attention(" in out
    assert "tree_flex_attention_interval" in out
    assert "█" in out and "tree mask (interval)" in out
    assert_matches_docs("qwen3-tiny", out)


# ---------------------------------------------------------------------------- module:factory


def test_factory_from_the_test_models_matches_the_docs(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, _ = run(capsys, "tests.test_compile_models:ManualGPT")
    assert code == 0
    assert "rewrite_attention_pass [softmax_attention=2]" in out and "rewrite_positions_pass [arange=1]" in out
    assert re.search(r"^-    pos = torch\.arange\(0, s\d+", out, re.M)  # the row index the positions pass replaced
    assert_matches_docs("tests.test_compile_models:ManualGPT", out)


def test_factory_from_a_user_module_in_the_working_directory(user_module, capsys):
    code, out, _ = run(capsys, f"{user_module}:make_gpt", "--json", "--mask", "bitmask", "--dtype", "float64")
    assert code == 0
    data = json.loads(out)
    assert data["source"] == "factory" and "float64" in data["model"]
    assert data["counters"]["rewrite_attention_pass"] == {"softmax_attention": 3}
    assert data["counters"]["rewrite_positions_pass"] == {"arange": 1}
    assert data["counters"]["gather_logits_pass"] == {"gather_before_lm_head": 1}
    # The bitmask rule gives the same picture as the interval rule.
    assert data["attention_mask"]["kind"] == "bitmask"
    sub = data["example"]["subtree_end"]
    assert data["attention_mask"]["rows"] == [[int(k <= q < sub[k]) for k in range(len(sub))] for q in range(len(sub))]
    assert len(data["example"]["path_bits"]) == EXAMPLE_ROWS


def test_fused_lm_head_is_inspected_through_the_pipeline_tree_compile_runs(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, _ = run(capsys, "tests.test_compile_models:ManualGPT", "--json", "--lm-head", "fused")
    assert code == 0, out
    data = json.loads(out)
    assert data["lm_head"] == "fused"
    assert [p["name"] for p in data["passes"]] == [
        "fuse_lm_head_pass" if n == "gather_logits_pass" else n for n in PASS_NAMES
    ]
    assert data["counters"]["fuse_lm_head_pass"] == {"fused_lm_head": 1}
    assert "gather_logits_pass" not in data["counters"]


# ---------------------------------------------------------------------------- refusals and errors


def test_refused_model_exits_1_naming_the_op(capsys, monkeypatch):
    code, out, _ = run(capsys, "test_compile_models:BiGruLM")
    assert code == 1
    assert "REFUSED in route_ssm_state_pass" in out
    assert "node 'rnn'" in out and "recurrent layer that is bidirectional" in out and "self.rnn(self.emb(idx))" in out
    code, out, err = run(capsys, "test_compile_models:BiGruLM", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["refused"] and data["refused_at"] == "route_ssm_state_pass" and "recurrent layer" in data["refusal"]
    assert data["passes"][-1]["refused"] and data["rewritten"] is None
    assert "refused" in err and "recurrent layer" in err


def test_model_dynamo_cannot_capture_is_refused(user_module, capsys):
    code, out, _ = run(capsys, f"{user_module}:Branchy")
    assert code == 1
    assert "treecompile cannot capture this model: `if x.sum().item() > 0:` at" in out, out


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_dir", "is not a directory with a config.json, a JSON config file, or module:factory"),
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("user_lm:missing", "module 'user_lm' has no attribute 'missing'"),
        ("user_lm:make_not_a_module", "make_not_a_module() returned a int, not a torch.nn.Module"),
        ("user_lm:", "expected module:factory"),
        ("not_a_config.json", "is not a Hugging Face model config (it has no 'model_type')"),
        ("broken.json", "is not valid JSON"),
        ("empty_dir", "has no config.json"),
    ],
    ids=["missing-path", "missing-module", "missing-attr", "not-a-module", "no-factory", "no-model-type",
         "bad-json", "dir-without-config"],
)
def test_bad_model_spec_is_a_clear_error(spec, message, user_module, tmp_path, capsys):
    (tmp_path / "not_a_config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "empty_dir").mkdir()
    code, out, err = run(capsys, spec)
    assert code == 2 and out == ""
    assert err.startswith("treecompile inspect: error: ") and message in err, err


def test_huge_config_is_refused_before_it_is_built(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    big = dict(QWEN3, vocab_size=150_000, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    transformers.Qwen3Config(**big).save_pretrained(tmp_path)
    code, _, err = run(capsys, str(tmp_path))
    assert code == 2
    assert re.search(r"describes a \d+\.\dB-parameter model", err) and "--allow-large" in err


# ---------------------------------------------------------------------------- pieces


def test_mask_picture_marks_nodes_and_trees():
    from treecompile import pack

    batch = pack(example_trees(), path_bits=True)
    dense = batch.reference_attention_mask()
    assert torch.equal(mask_matrix(batch, "interval"), dense)
    assert torch.equal(mask_matrix(batch, "bitmask"), dense)
    text = mask_picture(batch)
    grid = [ln for ln in text.splitlines() if re.match(r"^\s*\d+\s+n\d+", ln)]
    assert len(grid) == batch.num_tokens
    cells = [ln.split("  ")[-1].replace("│", " ").replace("║", " ").split() for ln in grid]
    assert [[c == "█" for c in row] for row in cells] == dense.tolist()
    # One horizontal rule per node start after the first; the tree boundary drawn doubled.
    rules = [ln for ln in text.splitlines() if set(ln.strip()) <= set("─┼╫═╪╬") and ln.strip()]
    assert len(rules) == batch.num_nodes - 1
    assert sum("═" in ln for ln in rules) == batch.num_trees - 1
    assert mask_picture(batch, "bitmask").splitlines()[3:] == text.splitlines()[3:]
    assert len(EXAMPLE_SEQUENCES) == batch.num_trees


def test_png_is_a_valid_image():
    from treecompile import pack

    batch = pack(example_trees())
    blob = png_bytes(batch, cell=3)
    side = 3 * batch.num_tokens
    assert struct.unpack(">II", blob[16:24]) == (side, side)
    # Decode the one IDAT chunk and check a visible and a hidden cell's colours.
    idat_at = blob.index(b"IDAT")
    n = struct.unpack(">I", blob[idat_at - 4 : idat_at])[0]
    raw = zlib.decompress(blob[idat_at + 4 : idat_at + 4 + n])
    stride = 1 + 3 * side
    assert len(raw) == side * stride and all(raw[y * stride] == 0 for y in range(side))

    def pixel(q: int, k: int) -> tuple[int, ...]:
        y, x = q * 3 + 1, k * 3 + 1  # cell centres, off the boundary lines
        return tuple(raw[y * stride + 1 + 3 * x : y * stride + 4 + 3 * x])

    assert pixel(1, 0) != pixel(0, 1)  # row 1 sees row 0; row 0 does not see row 1
    assert blob.endswith(b"IEND\xaeB`\x82")
    with pytest.raises(ValueError, match="at least 1 pixel"):
        png_bytes(batch, cell=0)


def test_the_module_imports_nothing_heavy():
    code = (
        "import argparse, sys; from treecompile.cli.inspect_cmd import add_command; "
        "add_command(argparse.ArgumentParser().add_subparsers()); "
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


# ---------------------------------------------------------------------------- docs


_OUTPUT_MARK = re.compile(r"^<!--\s*inspect-output:\s*(\S+)\s*-->\s*$")


def docs_outputs() -> dict[str, str]:
    """The ```text blocks of docs/passes.md marked ``<!-- inspect-output: MODEL -->``, by MODEL."""
    lines = PASSES_PAGE.read_text(encoding="utf-8").splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = _OUTPUT_MARK.match(line)
        if m:
            assert lines[i + 1].startswith("```"), f"docs/passes.md line {i + 2}: a fence must follow {line!r}"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            out[m.group(1)] = "\n".join(lines[i + 2 : end])
    return out


_HEADERS = ("model:", "example:", "captured graph:", "== pass ")


# Graph sizes, which change with the torch and transformers versions (transformers 5.24's Qwen3
# captures 2 nodes fewer than 5.10 to 5.23); what each pass adds or removes is kept.
_SIZES = (
    (re.compile(r"captured graph: \d+ nodes, \d+ lines"), "captured graph: N nodes, L lines"),
    (re.compile(r"\b\d+ -> \d+\b"), "N -> N"),
    (re.compile(r"\bnodes_checked=\d+"), "nodes_checked=N"),
)


def _without_sizes(line: str) -> str:
    for pattern, repl in _SIZES:
        line = pattern.sub(repl, line)
    return line


def essentials(text: str) -> tuple[list[str], list[str]]:
    """The header and per-pass lines (graph sizes left out), and the mask picture's rows, of an
    inspect output."""
    lines = text.splitlines()
    heads = [_without_sizes(ln) for ln in lines
             if ln.startswith(_HEADERS) or any(ln.startswith(f"  {p} ") for p in PASS_NAMES)]
    grid = [ln for ln in lines if ("█" in ln or "·" in ln or "┼" in ln) and not ln.startswith(("+", "-"))]
    return heads, grid


def test_the_docs_check_ignores_graph_sizes_but_not_what_a_pass_does():
    pasted = "\n".join([
        "captured graph: 220 nodes, 215 lines of code",
        "== pass 1/8 inline_subgraphs_pass [-]; nodes 220 -> 219 (-1)",
        "== pass 8/8 verify_graph_pass [nodes_checked=163]; graph unchanged",
        "  inline_subgraphs_pass      220 -> 219       -",
    ])
    other_version = pasted.replace("220", "218").replace("219", "217").replace("163", "161")
    assert essentials(other_version) == essentials(pasted)
    assert essentials(pasted.replace("(-1)", "(+0)")) != essentials(pasted)
    assert essentials(pasted.replace("[-]", "[hf_interface=2]")) != essentials(pasted)


def assert_matches_docs(model: str, out: str) -> None:
    pasted = docs_outputs()
    assert model in pasted, f"docs/passes.md has no <!-- inspect-output: {model} --> block"
    doc_heads, doc_grid = essentials(pasted[model])
    heads, grid = essentials(out)
    hint = f"docs/passes.md is stale: paste the output of `treecompile inspect {model}` again"
    assert doc_heads == heads, f"{hint}\n  docs:   {doc_heads}\n  actual: {heads}"
    if doc_grid:
        assert doc_grid == grid, hint


def _save_qwen3_next(path):
    """A tiny Qwen3-Next config directory: a linear-attention layer, then a full-attention one."""
    transformers = pytest.importorskip("transformers")
    transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0,
    ).save_pretrained(path)


@pytest.mark.full
def test_qwen3_next_config_shows_the_routed_conv_and_ssm_nodes(tmp_path, capsys):
    _save_qwen3_next(tmp_path / "qwen3-next")
    code, out, _ = run(capsys, str(tmp_path / "qwen3-next"), "--json")
    assert code == 0, out
    data = json.loads(out)
    counters = data["counters"]
    assert counters["rewrite_conv_context_pass"] == {"causal_conv1d": 1}
    assert counters["route_ssm_state_pass"] == {"gated_delta_rule": 1}
    assert counters["rewrite_attention_pass"] == {"hf_interface": 1}
    code, text, _ = run(capsys, str(tmp_path / "qwen3-next"))
    assert "tree_causal_conv1d" in text and "tree_gated_delta_rule" in text


# ---------------------------------------------------------------------------- the streamed part graph


def test_stream_rows_shows_the_part_graph_with_the_stack_inputs_and_outputs(capsys, monkeypatch):
    from treecompile import pack
    from treecompile.stream.options import plan_stream

    monkeypatch.chdir(ROOT)
    code, out, _ = run(capsys, "tests.test_compile_models:ManualGPT", "--stream-rows", "8")
    assert code == 0, out
    plan = plan_stream(pack(example_trees()), 8)
    assert plan.num_parts > 1
    assert "stream_rows=8" in out.splitlines()[1]
    assert "read_stream_inputs_pass [prefix_kv_inputs=4]" in out  # two layers' keys and values
    assert "route_prefix_kv_pass [prefix_attention=2]" in out
    assert "route_stream_state_pass [kv_outputs=4]" in out
    # Each attention now reads its layer's prefix keys and values from the stack.
    assert re.search(r"^\+    stream_tree_attention\w* = \w+\(\w+, \w+, \w+, l_prefix_0_, l_prefix_1_, ", out, re.M)
    assert re.search(r"^\+    stream_tree_attention\w* = \w+\(\w+, \w+, \w+, l_prefix_2_, l_prefix_3_, ", out, re.M)
    assert (f"stream variant: parts of at most 8 rows: {plan.num_parts} parts, stack depth {plan.stack_depth}, "
            f"longest prefix {plan.max_prefix} rows") in out
    assert "stack inputs: prefix keys/values l_prefix_0_, l_prefix_1_, l_prefix_2_, l_prefix_3_; conv contexts -" in out
    returned = re.search(r"returned for later parts: (.*)", out).group(1).split(", ")
    assert len(returned) == 4
    # ... and they are what the part graph returns besides its loss and log-probabilities.
    assert re.search(r"^\+    return \(loss, \w+, " + ", ".join(returned) + r"\)$", out, re.M)

    code, text, _ = run(capsys, "tests.test_compile_models:ManualGPT", "--stream-rows", "8", "--json")
    data = json.loads(text)
    assert data["stream"]["outputs"] == returned and data["stream"]["parts"] == plan.num_parts
    assert len(data["stream"]["index_inputs"]) == 4
    stream_passes = ["read_stream_inputs_pass", "route_prefix_kv_pass", "route_stream_state_pass"]
    names = [p["name"] for p in data["passes"]]
    assert [n for n in names if n not in stream_passes] == PASS_NAMES
    assert [n for n in names if n in stream_passes] == stream_passes  # once: the last compile's passes


@pytest.mark.full
def test_stream_rows_shows_a_hybrids_conv_and_state_routing(tmp_path, capsys):
    _save_qwen3_next(tmp_path / "qwen3-next")
    code, out, _ = run(capsys, str(tmp_path / "qwen3-next"), "--json", "--stream-rows", "6")
    assert code == 0, out
    data = json.loads(out)
    st = data["stream"]
    assert data["counters"]["read_stream_inputs_pass"] == {"prefix_kv_inputs": 2, "conv_inputs": 1, "state_inputs": 1}
    assert data["counters"]["route_stream_state_pass"] == {"conv_context": 1, "recurrent_state": 1, "kv_outputs": 2}
    assert len(st["prefix_kv_inputs"]) == 2 and len(st["conv_inputs"]) == 1 and len(st["state_inputs"]) == 1
    assert len(st["outputs"]) == 4  # keys, values, the conv inputs and the read-out states


def test_stream_rows_that_would_not_stream_are_refused():
    from treecompile.compile.inspection import inspect_model
    from test_compile_models import ManualGPT

    model = ManualGPT()
    with pytest.raises(ValueError, match=f"holds the whole example \\({EXAMPLE_ROWS} rows\\)"):
        inspect_model(model, stream_rows=EXAMPLE_ROWS)
    with pytest.raises(ValueError, match="stream_rows needs mask='interval'"):
        inspect_model(model, mask="bitmask", stream_rows=4)
    with pytest.raises(ValueError, match="positive int"):
        inspect_model(model, stream_rows=0)
