"""What the compiled model accepts: every batch is validated before it runs, and
``tree_compile`` names what it expects when given something that is not a causal LM."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from test_compile_models import NanoGPT, make_batch, tiny

import treecompile as tc
from treecompile.core.errors import TreeInputError


@pytest.fixture(scope="module")
def compiled():
    return tc.tree_compile(tiny(NanoGPT, vocab=64), backend="eager")


def _concatenated(a: tc.TreeBatch, b: tc.TreeBatch) -> tc.TreeBatch:
    """Two batches glued field by field, as a careless collator would."""
    fields = {}
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        fields[f.name] = torch.cat([x, y]) if isinstance(x, torch.Tensor) and x.dim() == 1 else x
    return tc.TreeBatch(**fields)


def _snapshot(batch: tc.TreeBatch) -> dict:
    return {f.name: getattr(batch, f.name).clone() for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)}


def _assert_untouched(batch: tc.TreeBatch, before: dict) -> None:
    for name, t in before.items():
        assert torch.equal(getattr(batch, name).nan_to_num(7.5), t.nan_to_num(7.5)), f"{name} was modified"


def test_concatenated_batches_are_refused_before_running(compiled):
    a, _ = make_batch("branchy", path_bits=False)
    b, _ = make_batch("forest", path_bits=False)
    bad = _concatenated(a, b)
    before = _snapshot(bad)
    with pytest.raises(TreeInputError, match=r"^invalid TreeBatch: nodes must tile the row"):
        compiled(bad)
    _assert_untouched(bad, before)


def test_ids_beyond_the_vocabulary_are_refused(compiled):
    batch, _ = make_batch("single", path_bits=False)
    batch = dataclasses.replace(batch, input_ids=batch.input_ids.clone())
    batch.input_ids[3] = 64
    with pytest.raises(TreeInputError, match=r"input_ids\[3\] = 64 is out of range for vocab_size=64"):
        compiled(batch)


def test_nan_weights_are_refused(compiled):
    batch, _ = make_batch("branchy", path_bits=False)
    weight = batch.target_weight.clone()
    weight[2] = float("nan")
    bad = dataclasses.replace(batch, target_weight=weight)
    before = _snapshot(bad)
    with pytest.raises(TreeInputError, match=r"target_weight\[2\] = nan: weights must be finite"):
        compiled(bad)
    _assert_untouched(bad, before)


def test_mismatched_field_shapes_are_refused(compiled):
    batch, _ = make_batch("branchy", path_bits=False)
    bad = dataclasses.replace(batch, position_ids=batch.position_ids[:-1])
    with pytest.raises(TreeInputError, match=r"position_ids has shape \(10,\), expected \(11,\)"):
        compiled(bad)


def test_bitmask_without_path_bits_is_refused():
    compiled = tc.tree_compile(tiny(NanoGPT), mask="bitmask", backend="eager")
    batch, _ = make_batch("branchy", path_bits=False)
    with pytest.raises(TreeInputError, match=r"mask='bitmask' needs path bits"):
        compiled(batch)


@pytest.mark.parametrize(
    "thing, what",
    [
        ("Qwen/Qwen3-0.6B", r"got str 'Qwen/Qwen3-0.6B'"),
        (nn.Linear(4, 4), r"got a bare torch.nn.Linear, which is one layer, not a model"),
        (None, r"got NoneType"),
    ],
    ids=["string", "linear", "none"],
)
def test_tree_compile_names_what_it_expects(thing, what):
    with pytest.raises(TypeError, match=r"^tree_compile expects a causal language model: .*" + what):
        tc.tree_compile(thing)


def test_a_hugging_face_base_model_without_lm_head_is_refused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(TypeError, match=r"got Qwen3Model, a base model without an LM head"):
        tc.tree_compile(transformers.AutoModel.from_config(cfg))


def test_an_already_compiled_model_is_refused(compiled):
    with pytest.raises(TypeError, match="already tree-compiled"):
        tc.tree_compile(compiled)


def test_a_path_longer_than_the_model_context_warns():
    transformers = pytest.importorskip("transformers")
    from treecompile.core.advice import TreeWarning

    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                   max_position_embeddings=8)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    batch, _ = make_batch("single", path_bits=False)  # one path of 9 tokens
    with pytest.warns(TreeWarning, match=r"the longest path has 9 tokens \(tree 0\), more than the model.s max_position_embeddings = 8"):
        tc.tree_compile(model, backend="eager")(batch)


def test_a_model_on_the_meta_device_is_refused_as_having_no_data():
    with torch.device("meta"):
        model = NanoGPT(layers=1)
    with pytest.raises(TypeError, match=r"NanoGPT is on the meta device \(\S+ and others have a shape but no data\)"):
        tc.tree_compile(model)


_HOST_READS = ("cpu", "numpy", "tolist", "item", "__int__", "__bool__", "__float__", "__index__")


#: Modules that run on the CPU only (their reads of a tensor are no device sync).
CPU_ONLY = {"treecompile.kernels.attention.cpu_attention"}


def test_a_packed_batch_runs_without_reading_the_device(compiled, monkeypatch):
    """After the first call, a call on a packed batch reads none of its tensors on the host in
    treecompile's own code (each read is a device sync on a GPU): the checks, the longest path,
    the head index and the node table come from the check `pack` made on the host. (The CPU
    attention kernel reads its block table; it is not run on GPUs.)"""
    import sys

    batch, _ = make_batch("branchy", path_bits=False)
    compiled(batch)  # compiles
    again, _ = make_batch("forest", path_bits=False)
    reads = []

    def counted(real, name):
        def read(*args, **kwargs):
            # By the caller's module, not its file's path: a checkout may be named anything.
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if (module == "treecompile" or module.startswith("treecompile.")) and module not in CPU_ONLY:
                reads.append(f"{name} at {module}:{caller.f_lineno}")
            return real(*args, **kwargs)
        return read

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name), name))
    for name in ("nonzero", "unique"):
        monkeypatch.setattr(torch, name, counted(getattr(torch, name), f"torch.{name}"))
    compiled(again)
    compiled(batch)
    assert reads == []


@pytest.mark.full
def test_an_fsdp2_model_runs_unsharded_and_its_shards_get_the_gradients(tmp_path):
    """FSDP2's hooks gather and free parameters outside any graph: a call gathers every unit
    first and the backward puts each gradient in its shard (a one-process gloo group is
    enough to shard). Equal to the unsharded model's, whole and streamed, accumulating over
    calls with and without FSDP2's gradient synchronisation; verify=True refused."""
    import torch.distributed as dist

    from treecompile.distributed.data_parallel import wrap_fsdp
    from treecompile.stream.options import StreamOptions

    torch.manual_seed(0)
    model = tiny(NanoGPT, layers=2)
    batch = tc.pack(tc.TrajectoryTree.from_sequences([[1, 2, 3, 4], [1, 2, 5], [6, 7]]), warn_por=False)
    small = tc.pack(tc.TrajectoryTree.from_sequences([[1, 2], [1, 3]]), warn_por=False)  # 3 rows: not streamed
    plain = tc.tree_compile(model, backend="eager")
    grads = {}
    for name_, b in (("small", small), ("batch", batch)):
        plain(b).loss.backward()
        grads[name_] = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    small_grads, grads = grads["small"], grads["batch"]
    stream = StreamOptions(budget_rows=3)  # parts of 3 rows: the tree's 7 rows stream
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        wrap_fsdp(model, layers=list(model.blocks))
        compiled = tc.tree_compile(model, backend="eager")
        for _ in range(2):  # twice: the shards come back after each backward, and accumulate
            compiled(batch).loss.backward()
        for n, p in model.named_parameters():
            assert type(p).__name__ == "DTensor", n
            torch.testing.assert_close(p.grad.full_tensor(), 2 * grads[n], rtol=1e-12, atol=1e-12, msg=n)
        # FSDP2's gradient accumulation without communication (verl's non-final micro-batches):
        # no reduce-scatter until a backward with synchronisation on, then one per parameter.
        model.zero_grad(set_to_none=True)
        name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        calls, collective = [], getattr(dist, name)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dist, name, lambda *a, **k: calls.append(1) or collective(*a, **k))
            model.set_requires_gradient_sync(False)
            for _ in range(2):
                compiled(batch).loss.backward()
            assert calls == [] and all(p.grad is None for p in model.parameters())
            model.set_requires_gradient_sync(True)
            compiled(batch).loss.backward()
            assert len(calls) == sum(1 for p in model.parameters() if type(p).__name__ == "DTensor")
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), 3 * grads[n], rtol=1e-12, atol=1e-12, msg=n)
        model.zero_grad(set_to_none=True)
        streamed = tc.tree_compile(model, backend="eager", stream=stream)
        streamed(batch).loss.backward()
        assert streamed._stream.stats.parts > 1
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), grads[n], rtol=1e-12, atol=1e-12, msg=n)
        # Unsynchronised whole-tree calls of one wrapper, then a synchronised call of another
        # wrapper of the model, whole-tree (3 rows: under the budget) or streamed: the kept
        # gradients reach the shards with it, whichever it is.
        for last, extra in ((small, small_grads), (batch, grads)):
            model.zero_grad(set_to_none=True)
            model.set_requires_gradient_sync(False)
            compiled(small).loss.backward()
            model.set_requires_gradient_sync(True)
            streamed(last).loss.backward()
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad.full_tensor(), small_grads[n] + extra[n], rtol=1e-12, atol=1e-12,
                                           msg=n)
        with pytest.raises(ValueError, match="copies the model to one process"):
            tc.tree_compile(model, verify=True)
    finally:
        dist.destroy_process_group()


def test_an_fsdp1_model_is_refused_by_name():
    """FSDP1's flat parameters are gathered in hooks outside the graph: refused, naming the
    unit (its class as torch names it: FSDP1 needs an accelerator to build one)."""
    fsdp1 = type("FullyShardedDataParallel", (torch.nn.Module,),
                 {"__module__": "torch.distributed.fsdp.fully_sharded_data_parallel"})
    model = tiny(NanoGPT, layers=2)
    model.blocks[0] = fsdp1()
    model.blocks[0].inner = torch.nn.Identity()
    with pytest.raises(TypeError, match=r"NanoGPT is sharded by FSDP \(blocks\.0\), FSDP1: .*shard with FSDP2"):
        tc.tree_compile(model)


def test_padded_rows_may_be_passed_positionally_as_input_ids():
    """``compiled(ids)`` is ``compiled(input_ids=ids)``: padded rows, as a Hugging Face model takes them."""
    torch.manual_seed(0)
    compiled = tc.tree_compile(tiny(NanoGPT, layers=1))
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6]])
    assert torch.equal(compiled(ids).loss, compiled(input_ids=ids).loss)


def test_labels_beside_a_packed_batch_are_refused_unless_they_are_its_own(compiled):
    """``compiled(batch, labels=...)`` ignored the labels (the batch holds its targets): refused
    by name now; the labels TreeCollator returns with its batch are its own targets and taken."""
    batch, _ = make_batch("branchy", path_bits=False)
    labels = torch.full((batch.num_paths, 8), -100)
    with pytest.raises(TreeInputError, match=r"labels= beside a TreeBatch would not be read"):
        compiled(batch, labels=labels)
    assert torch.isfinite(compiled(batch.mark_labels_beside().to("cpu"), labels=labels).loss)
