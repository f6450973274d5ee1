"""Ops inside subgraphs are rewritten and verified like every other op: activation-checkpoint
regions are inlined; other higher-order ops with a body are refused by name."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from test_compile_models import NanoGPT, compare_with_paths, make_batch, tiny
from testing import perturbed_hf_model

import treecompile as tc
from treecompile.core.errors import UnsupportedModelError


class CheckpointedGPT(NanoGPT):
    """NanoGPT with every block under ``torch.utils.checkpoint`` (non-reentrant), attention inside."""

    def forward(self, idx):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.emb(idx)
        for blk in self.blocks:
            x = checkpoint(blk, x, pos, use_reentrant=False)
        return self.head(self.norm(x))


@pytest.mark.full
def test_attention_inside_checkpointed_blocks_is_rewritten_and_exact():
    model = tiny(CheckpointedGPT)
    compiled = tc.tree_compile(model)
    for name in ("branchy", "forest"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="pure")
    assert dict(compiled.counters["inline_subgraphs_pass"]) == {"checkpoint": 2}
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"sdpa": 2}
    (record,) = compiled.compile_records
    tagged = [n for n in record.graph_module.graph.nodes if "ac_graph_id" in n.meta]
    assert {n.meta["ac_graph_id"] for n in tagged} == {0, 1}


@pytest.mark.full
def test_hugging_face_gradient_checkpointing_is_exact():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = perturbed_hf_model(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # HF checkpoints only in training mode (attention dropout is 0)
    compiled = tc.tree_compile(model)
    for name in ("branchy", "single"):
        batch, trees = make_batch(name)
        compare_with_paths(model, compiled, batch, trees, tol="hf")
    assert dict(compiled.counters["inline_subgraphs_pass"]) == {"checkpoint": 2}
    assert dict(compiled.counters["rewrite_attention_pass"]) == {"hf_interface": 2}


class CondGPT(NanoGPT):
    def forward(self, idx):
        y = super().forward(idx)
        return torch.cond(idx.shape[1] > 4, lambda t: t * 2.0, lambda t: t.cumsum(1), (y,))


def test_a_higher_order_op_with_a_body_is_refused_by_name():
    batch, _ = make_batch("branchy")
    with pytest.raises(UnsupportedModelError, match=r"^treecompile cannot make this model exact on a tree: node .*"
                                                    r"higher-order op \(cond"):
        tc.tree_compile(tiny(CondGPT))(batch)
