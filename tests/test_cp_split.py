"""Splitting a packed tree row over context-parallel ranks by work (`treecompile.distributed.cp_split`),
against brute force over every contiguous split and against the dense tree mask."""

from __future__ import annotations

import doctest
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import treecompile as tc
from treecompile.core.errors import TreeInputError
from treecompile.distributed import cp_split as cp
from treecompile.planning.budget import ModelDims
from treecompile.distributed.cp_split import RowWork, equal_rows_split, split_for_cp

WORK = RowWork(dense=1.0, attention=0.3, head=2.0)


def _batch(seqs):
    return tc.pack(tc.TrajectoryTree.from_sequences(seqs), warn_por=False)


def _brute_force_best(batch, ranks: int, work: RowWork, align: int = 1) -> float:
    """The least largest-rank work over every contiguous split with aligned cuts."""
    s = batch.num_tokens
    candidates = [c for c in range(1, s) if c % align == 0]
    best, costs = np.inf, cp._row_costs(batch, work)
    for k in range(ranks):  # some ranks may hold nothing when the row is short
        for cuts in itertools.combinations(candidates, k):
            bounds = np.array([0, *cuts, *([s] * (ranks - k))], dtype=np.int64)
            best = min(best, float(cp._summary(bounds, costs).work.max()))
    return best


trees = st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=9), min_size=1, max_size=5)


@given(seqs=trees, ranks=st.integers(1, 3), align=st.sampled_from([1, 2, 4]))
def test_the_largest_ranks_work_is_the_least_any_contiguous_split_gives(seqs, ranks, align):
    batch = _batch(seqs)
    if batch.num_tokens < ranks:
        return
    split = split_for_cp(batch, ranks, WORK, align=align)
    assert split.bounds[0] == 0 and split.bounds[-1] == batch.num_tokens and np.all(np.diff(split.bounds) >= 0)
    assert all(b % align == 0 for b in split.bounds[1:-1] if b != batch.num_tokens)
    predicting = np.unique(batch.pred_index.numpy()[batch.pred_index.numpy() >= 0])
    assert split.rows.sum() == batch.num_tokens and split.head_rows.sum() == len(predicting)
    best = _brute_force_best(batch, ranks, WORK, align)
    assert split.work.max() <= best * (1 + 1e-9)


def _path_mask(batch) -> np.ndarray:
    """``[S, S]``: query ``i`` sees key ``j`` iff some path holds both and ``j`` is not after ``i``."""
    mask = np.zeros((batch.num_tokens, batch.num_tokens), dtype=bool)
    for p in range(batch.num_paths):
        rows = batch.path_rows(p).numpy()
        for k, i in enumerate(rows):
            mask[i, rows[: k + 1]] = True
    return mask


@pytest.mark.parametrize("seqs", [[[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 7, 8], [9, 10]],
                                  # over one query block (128 rows) per rank
                                  [list(range(1, 151)) + [200 + k] * (60 + 7 * k) for k in range(4)]],
                         ids=["small", "blocks"])
def test_counts_match_the_dense_tree_mask(seqs):
    from treecompile.planning.budget import CPU_BLOCK_ROWS, CPU_CALL_ROWS

    batch = _batch(seqs)
    mask = _path_mask(batch)
    for ranks in (1, 2, 3, 4):
        split = split_for_cp(batch, ranks, WORK)
        for r in range(ranks):
            a, b = int(split.bounds[r]), int(split.bounds[r + 1])
            assert split.attention_pairs[r] == mask[a:b].sum()
            # The keys of earlier ranks its queries see: the root path of its first row.
            assert split.ancestor_rows[r] == (mask[a:b, :a].any(0).sum() if b > a else 0)
            # The most keys one CPU attention call sees: up to CPU_CALL_ROWS queries from a block's start.
            blocks = [mask[q:min(q + CPU_CALL_ROWS, b), :min(q + CPU_CALL_ROWS, b)].any(0).sum()
                      for q in range(a, b, CPU_BLOCK_ROWS)]
            assert split.live_keys[r] == max(blocks, default=0)


@given(seqs=trees, ranks=st.integers(1, 4))
def test_the_exchange_hands_each_rank_exactly_the_keys_its_queries_see(seqs, ranks):
    """`CPSplit.exchange`: what the other ranks send a rank, concatenated in rank order, is
    the set of earlier keys its queries see under the dense tree mask, in row order (the order
    its gather index assumes); the send and receive counts of every pair of ranks agree;
    ``sent_rows`` is what each rank sends."""
    batch = _batch(seqs)
    if batch.num_tokens < ranks:
        return
    split = split_for_cp(batch, ranks, WORK)
    mask = _path_mask(batch)
    plans = [split.exchange(r) for r in range(ranks)]
    for r in range(ranks):
        a, b = int(split.bounds[r]), int(split.bounds[r + 1])
        sees = np.flatnonzero(mask[a:b, :a].any(0)) if b > a else np.zeros(0, np.int64)
        got = []
        for s, (send_rows, send_counts, _) in enumerate(plans):
            start = int(send_counts[:r].sum())
            got.append(send_rows[start:start + int(send_counts[r])] + split.bounds[s])
        got = np.concatenate(got)
        assert np.array_equal(got, sees) and np.array_equal(split.paths[r], sees), (r, got, sees)
        assert [int(plans[s][1][r]) for s in range(ranks)] == plans[r][2].tolist()
        assert int(plans[r][1].sum()) == int(split.sent_rows[r]) == len(plans[r][0])
        assert plans[r][1][r] == 0 and plans[r][2][r] == 0


def test_work_split_beats_rows_on_a_shared_prompt_with_long_branches():
    prompt = list(range(1, 200))
    seqs = [prompt + [300 + k] * 100 for k in range(4)]
    batch = _batch(seqs)
    work = RowWork.from_dims(ModelDims(layers=8, hidden=2048, intermediate=6144, heads=16, kv_heads=8, head_dim=128,
                                       vocab=151936))
    by_work, by_rows = split_for_cp(batch, 4, work), equal_rows_split(batch, 4, work)
    assert by_work.imbalance() < by_rows.imbalance()
    assert by_work.imbalance() < 1.05
    kv = by_work.kv_bytes(kv_heads=8, head_dim=128, dtype_bytes=2)
    assert kv[0] == 0 and (kv[1:] > 0).all()
    everything = by_work.kv_bytes(kv_heads=8, head_dim=128, dtype_bytes=2, gather="all")
    assert (everything >= kv).all()


def test_bad_requests_are_refused():
    batch = _batch([[1, 2, 3]])
    with pytest.raises(TreeInputError, match="a row of 3 tokens cannot be split over 4 ranks"):
        split_for_cp(batch, 4)
    with pytest.raises(TreeInputError, match="ranks must be a positive integer"):
        split_for_cp(batch, 0)
    with pytest.raises(TreeInputError, match="align must be at least 1"):
        split_for_cp(batch, 1, align=0)
    with pytest.raises(ValueError, match="unknown gather 'some'; valid: needed, all"):
        split_for_cp(batch, 1).kv_bytes(1, 1, 1, gather="some")


def test_module_examples():
    assert doctest.testmod(cp).failed == 0


def test_peak_memory_of_a_rank_adds_the_keys_it_reads_to_its_own_rows():
    from treecompile.planning.budget import CostModel

    dims = ModelDims(layers=4, hidden=256, intermediate=768, heads=8, kv_heads=2, head_dim=32, vocab=1000)
    cost = CostModel.from_config(dims, dtype="bfloat16")
    prompt = list(range(1, 300))
    batch = _batch([prompt + [400 + k] * 200 for k in range(4)])
    one = split_for_cp(batch, 1).peak_bytes(cost)
    saved, transient = cost.part_bytes(batch.num_tokens, batch.num_tokens)
    assert one.tolist() == [cost.static_bytes() + saved + transient]  # one rank: the whole step
    split = split_for_cp(batch, 4, RowWork.from_dims(dims))
    peaks = split.peak_bytes(cost)
    per_row = 2 * dims.kv_heads * dims.head_dim * 2
    gather_buffer = 4 * int(split.rows.max()) * per_row // 2
    for r in range(4):
        rows, got = int(split.rows[r]), int(split.ancestor_rows[r])
        saved, transient = cost.part_bytes(rows, min(rows + got, int(split.live_keys[r])))
        assert peaks[r] == cost.static_bytes() + saved + dims.layers * got * per_row + max(transient, gather_buffer)
    assert (peaks < one[0]).all() and (split.peak_bytes(cost, gather="all") >= peaks).all()


@pytest.mark.parametrize("align", [1, 4, 16])
def test_the_work_split_is_no_worse_than_the_row_split_at_the_same_alignment(align):
    """Both cut on multiples of ``align``: the least largest work over such splits is at most
    the equal-row split's (the comparison `treecompile plan --cp --cp-align` prints)."""
    prompt = list(range(1, 120))
    batch = _batch([prompt + [200 + k] * (30 + 11 * k) for k in range(5)])
    for ranks in (2, 3, 4):
        by_work = split_for_cp(batch, ranks, WORK, align=align)
        by_rows = equal_rows_split(batch, ranks, WORK, align=align)
        assert all(b % align == 0 for b in by_rows.bounds[:-1]) and by_rows.bounds[-1] == batch.num_tokens
        assert by_work.work.max() <= by_rows.work.max() + 1e-9


@given(seqs=trees, ranks=st.integers(1, 4), budget=st.integers(1, 5), cuts=st.sampled_from(["subtree", "rows"]))
def test_a_streamed_part_split_over_ranks_reads_exactly_the_keys_its_queries_see(seqs, ranks, budget, cuts):
    """`treecompile.distributed.stream_cp.split_parts`: each part of a streamed plan is split over
    the ranks by rows (at most ``budget`` rows each); a rank's stack rows (earlier parts) and
    gathered rows (the part's earlier ranks), in that order, are exactly the earlier keys its
    queries see under the dense tree mask; the gathered rows are what the exchange hands it;
    a part's kept rows are exactly the rows later parts' ranks read from it; and a part's
    call inputs make its padding keys invisible and its real ones visible by the tree rule."""
    from treecompile.stream.parts import PAD_PREFIX, BatchArrays
    from treecompile.stream.plan import plan_stream
    from treecompile.distributed.stream_cp import PAD_GATHER, split_parts

    batch = _batch(seqs)
    plan = plan_stream(batch, budget * ranks, cuts)
    splits, kept = split_parts(batch, plan, ranks)
    mask = _path_mask(batch)
    data = BatchArrays(batch)
    read = [set() for _ in range(plan.num_parts)]
    for j, split in enumerate(splits):
        assert split.bounds[0] == plan.starts[j] and split.bounds[-1] == plan.starts[j + 1]
        assert (np.diff(split.bounds) >= 0).all() and np.diff(split.bounds).max() <= budget
        plans = [cp.exchange_of(split.bounds, split.inside, r) for r in range(ranks)]
        for r in range(ranks):
            a, b = int(split.bounds[r]), int(split.bounds[r + 1])
            stack, inside = split.stack[r], split.inside[r]
            sees = np.flatnonzero(mask[a:b, :a].any(0)) if b > a else np.zeros(0, np.int64)
            assert np.array_equal(np.concatenate([stack, inside]), sees), (j, r, stack, inside, sees)
            assert (stack < plan.starts[j]).all() and (inside >= plan.starts[j]).all()
            got = [plans[s][0][int(plans[s][1][:r].sum()):][:int(plans[s][1][r])] + split.bounds[s]
                   for s in range(ranks)]
            assert np.array_equal(np.concatenate(got), inside)
            for row in stack.tolist():
                read[int(plan.part_of(np.array([row]))[0])].add(row)
            # The call's keys: [padding ; stack ; padding ; gathered ; own]; query c sees key k
            # iff kv_end[k] > c >= k (the interval rule over the concatenation).
            prefix = np.concatenate([stack, np.full(PAD_GATHER, -1), inside])
            inputs, _ = data.part_inputs(a, b, prefix)
            kv_end = inputs[9].numpy()
            keys = np.concatenate([np.full(PAD_PREFIX, -1), prefix])
            for q in range(a, b):
                c = len(keys) + q - a
                seen = [k for k in range(len(keys)) if k <= c < kv_end[k]]
                assert [int(keys[k]) for k in seen] == np.flatnonzero(mask[q, :a]).tolist(), (j, r, q)
    assert [set(k.tolist()) for k in kept] == read


def test_a_model_the_memory_model_refuses_is_still_split_by_work():
    """CP balances work by the config's dimensions alone: Gemma 2, which the cost model
    refuses for memory (soft-capped logits, four norms a layer), still gets `RowWork`."""
    import types

    transformers = pytest.importorskip("transformers")
    from treecompile.planning.budget import BudgetError, CostModel
    from treecompile.distributed.context_parallel import row_work_of

    config = transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
                                       bos_token_id=1, eos_token_id=2)
    with pytest.raises(BudgetError, match="soft-caps its logits"):
        CostModel.from_config(config)
    want = RowWork.from_dims(ModelDims(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                                       vocab=256))
    assert row_work_of(types.SimpleNamespace(config=config)) == want
