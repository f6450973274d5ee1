"""The first-call probe (treecompile/compile/probe.py): on by default, cheap, and it refuses a model
that slips past the row rules, naming the op.

To build models that slip past the static check, a test replaces one rule of the table with
a wrong one (``cumsum`` judged element-wise) and turns off the pass that would rewrite the
scan to run along the paths: the static check then accepts a scan along the sequence,
exactly as it would accept an op whose rule had a hole, and only the probe stands between
the model and silently wrong training.
"""

from __future__ import annotations

import pytest
import torch
from test_compile_models import NanoGPT, make_batch, tiny
from torch import nn
from treecompile.passes.rows import RULES, Rule
from treecompile.passes.rows.elementwise import pointwise

import treecompile as tc
from treecompile.compile.probe import PROBE_TOLERANCE
from treecompile.core.errors import UnsupportedModelError


@pytest.fixture
def cumsum_rule_with_a_hole(monkeypatch):
    monkeypatch.setitem(RULES, "cumsum", Rule(pointwise, "pointwise"))


#: Leaves a scan along the sequence as it is (the conv context pass would make it exact).
NO_SCAN_REWRITE = ("rewrite_conv_context_pass",)


class RunningMeanLM(NanoGPT):
    """NanoGPT whose embeddings get a running mean over the sequence: mixes the rows of
    different paths (a sibling's tokens reach the rows after it)."""

    def forward(self, idx):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.emb(idx)
        x = x + 0.5 * x.cumsum(1)
        for blk in self.blocks:
            x = blk(x, pos)
        return self.head(self.norm(x))


class RowIndexPositionLM(NanoGPT):
    """NanoGPT whose positions are the row index counted with a float scan over the tokens
    (``(idx >= 0).cumsum(1) - 1``): on a packed row, a token's row index is not its position on
    its path. (A count that reads no token is a table the positions pass reads at positions.)"""

    def forward(self, idx):
        pos = ((idx >= 0).to(self.emb.weight.dtype).cumsum(1) - 1).long()[0]
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, pos)
        return self.head(self.norm(x))


def test_the_probe_runs_by_default_and_reports():
    batch, _ = make_batch("branchy")
    compiled = tc.tree_compile(tiny(NanoGPT, layers=1))
    compiled(batch)
    assert compiled.verify is tc.Verify.PROBE and len(compiled.probed) == 1
    report = compiled.probed[0]
    assert report.edited_rows_compared > 0 and report.alone_rows_compared > 0 and not report.skipped
    compiled(batch)  # no new graph, no new probe
    assert len(compiled.probed) == 1


def test_verify_false_turns_the_probe_off(cumsum_rule_with_a_hole):
    batch, _ = make_batch("branchy")
    compiled = tc.tree_compile(tiny(RunningMeanLM, layers=1), verify=False, disable_passes=NO_SCAN_REWRITE)
    compiled(batch)  # the hole lets it through: what verify=False means
    assert compiled.probed == []


def test_the_probe_refuses_a_branch_mixing_op_the_rules_let_through(cumsum_rule_with_a_hole):
    batch, _ = make_batch("branchy")
    compiled = tc.tree_compile(tiny(RunningMeanLM, layers=1), disable_passes=NO_SCAN_REWRITE)
    with pytest.raises(UnsupportedModelError) as info:
        compiled(batch)
    first, where = str(info.value).splitlines()[:2]
    assert "first-call probe found that node 'cumsum' (call_method cumsum) at test_probe.py:" in first, first
    assert "when only the tokens of another branch change" in first, first
    assert "x.cumsum(1)" in where, where
    # A refused model stays refused: its graph is not run again.
    with pytest.raises(UnsupportedModelError, match="first-call probe"):
        compiled(batch)


def test_the_probe_refuses_a_row_index_position_the_rules_let_through(cumsum_rule_with_a_hole):
    batch, _ = make_batch("branchy")
    compiled = tc.tree_compile(tiny(RowIndexPositionLM, layers=1), disable_passes=NO_SCAN_REWRITE)
    with pytest.raises(UnsupportedModelError) as info:
        compiled(batch)
    first = str(info.value).splitlines()[0]
    assert "first-call probe found that node 'cumsum'" in first, first
    assert "differs from the same token's row when its path runs alone" in first, first


@pytest.mark.full
def test_the_probe_runs_again_after_a_recompile():
    compiled = tc.tree_compile(tiny(NanoGPT, layers=1), mask="bitmask")
    batch, _ = make_batch("branchy")
    compiled(batch)
    paths = [[1, a, b] for a in range(2, 12) for b in range(2, 9)]
    compiled(tc.pack([tc.TrajectoryTree.from_sequences(paths)], path_bits=True))  # 70 paths, 2 chunks: a new graph
    assert len(compiled.compile_records) == 2 and len(compiled.probed) == 2


class DropoutLM(NanoGPT):
    def __init__(self):
        super().__init__(layers=1)
        self.drop = nn.Dropout(0.3)

    def forward(self, idx):
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.drop(self.emb(idx))
        for blk in self.blocks:
            x = blk(x, pos)
        return self.head(self.norm(x))


def test_a_model_that_draws_random_numbers_skips_the_comparisons_and_says_so():
    batch, _ = make_batch("branchy")
    compiled = tc.tree_compile(tiny(DropoutLM).train(), dropout="shared")
    compiled(batch)
    (report,) = compiled.probed
    assert report.edited_rows_compared == 0 and "random" in report.skipped[0]


def test_dropout_in_training_mode_is_refused_unless_shared_is_asked_for():
    """Per-path training draws a dropout mask per path, a tree one per shared token: another
    estimator. It is refused by default, naming the op and the option; in eval mode, or with
    dropout 0, nothing is drawn and nothing is refused."""
    batch, _ = make_batch("branchy")
    with pytest.raises(tc.UnsupportedModelError, match=r"(?s)dropout \(p=0.3\) in training mode.*"
                                                        r"dropout=\"shared\""):
        tc.tree_compile(tiny(DropoutLM).train())(batch)
    assert torch.isfinite(tc.tree_compile(tiny(DropoutLM).eval())(batch).loss)
    with pytest.raises(ValueError, match="unknown dropout 'yes'; valid: 'refuse', 'shared'"):
        tc.tree_compile(tiny(DropoutLM), dropout="yes")


@pytest.mark.full
def test_gpt2_with_residual_dropout_in_training_mode_is_refused_by_name():
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64, resid_pdrop=0.1,
                                  embd_pdrop=0.1, attn_pdrop=0.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).train()
    batch = tc.pack([tc.TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5]])])
    with pytest.raises(tc.UnsupportedModelError, match=r"dropout \(p=0.1\) in training mode"):
        tc.tree_compile(model)(batch)
    assert torch.isfinite(tc.tree_compile(model, dropout="shared")(batch).loss)


def test_verify_takes_probe_true_or_false():
    model = tiny(NanoGPT, layers=1)
    for value, member in [("probe", tc.Verify.PROBE), (True, tc.Verify.FULL), (False, tc.Verify.OFF),
                          (tc.Verify.OFF, tc.Verify.OFF)]:
        assert tc.tree_compile(model, verify=value).verify is member
    for bad in ("yes", 1, 0, None, "full"):
        with pytest.raises(ValueError, match=r"unknown verify .*; valid: 'probe', True, False"):
            tc.tree_compile(model, verify=bad)


def test_the_probe_leaves_the_training_step_unchanged():
    """The probe runs without gradients and restores the random state: the step's loss, its
    gradients and the next random draw are the same with and without it."""
    batch, _ = make_batch("forest")
    results = []
    for verify in ("probe", False):
        model = tiny(NanoGPT, layers=1)
        torch.manual_seed(3)
        out = tc.tree_compile(model, verify=verify)(batch)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in model.parameters()], torch.rand(3)))
    (loss_a, grads_a, draw_a), (loss_b, grads_b, draw_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(draw_a, draw_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.full
def test_a_float64_model_whose_router_multiplies_in_float32_is_judged_at_float32_rounding():
    """DeepSeek-V3's router casts to float32 before its product (``F.linear(h.type(torch.float32),
    w.type(torch.float32))``): a path run alone, with fewer rows, rounds that product differently by
    ~1e-7, which the float64 tolerance took for a row-order dependence (the model was refused at the
    router's sigmoid). The probe judges at the least precise dtype a product computes in; the model
    is exact to that rounding."""
    import transformers
    from testing import backward_grads, perturbed_hf_model

    from treecompile.core.reference import per_path_loss

    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=128)
    model = perturbed_hf_model(cfg, experts_implementation="eager")
    compiled = tc.tree_compile(model)
    for tree in (tc.TrajectoryTree.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 7, 9, 10, 11],
                                                   [12, 13]]),
                 tc.TrajectoryTree.from_sequences([[5, 6, 7], [5, 6, 8, 9]])):
        out, grads = backward_grads(model, lambda: compiled(tc.pack(tree, warn_por=False)))
        ref, ref_grads = backward_grads(model, lambda: per_path_loss(model, tree))
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
        for name, g in ref_grads.items():
            assert (grads[name] - g).abs().max() <= 1e-6 * max(g.abs().max().item(), 1e-12), name
    report = compiled.probed[0]
    assert report.alone_rows_compared > 0 and report.alone_tolerance == PROBE_TOLERANCE[torch.float32]


def test_a_float64_model_with_a_float32_softmax_is_probed_at_float32_rounding():
    """x-transformers' talking heads compute their softmax in float32 inside a float64 model: a
    path alone differs from its rows in the probe's forest by float32 rounding (2e-7), which is
    no sign of rows mixing. The probe judges at the least precise dtype the graph casts down to
    (it refused this one-path batch as an internal error, and then every later batch)."""
    import zoo
    import zoo_repos

    model = zoo_repos.BY_ID["x-transformers-talking-heads"].build()
    compiled = tc.tree_compile(model, backend="eager")
    trees = [tc.TrajectoryTree.from_sequences([[16, 22, 1, 29, 15, 3, 10, 7, 23, 30]])]
    zoo.compare(model, compiled, tc.pack(trees, warn_por=False), trees)
    assert compiled.probed and compiled.probed[0].alone_tolerance == PROBE_TOLERANCE[torch.float32]
