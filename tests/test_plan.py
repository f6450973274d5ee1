"""`treecompile plan`: the partition, POR, ERR, per-rank load and duplicated tokens of a file."""

import argparse
import json

import pytest

from treecompile.cli.plan import add_command, run


def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_command(sub)
    args = parser.parse_args(["plan", *argv])
    assert run(args) == 0
    return capsys.readouterr().out


def test_plan_json_on_the_bundled_sample(capsys):
    out = json.loads(_run(["sample:tau_bench", "--tokenizer", "sample", "--ranks", "2", "--json"], capsys))
    tot = out["total"]
    assert out["capacity_default"] and out["capacity"] >= out["longest_path"]
    assert tot["n_parts"] > tot["n_trees"], "half the largest tree must split it"
    assert 0 < tot["err"] <= tot["por"]
    assert tot["duplicated_tokens"] == tot["partition_tokens"] - tot["tree_tokens"]
    step = out["step"]
    assert len(step["rank_tokens"]) == 2 and all(t > 0 for t in step["rank_tokens"])
    assert all(m <= out["capacity"] for r in step["micro_tokens"] for m in r)


def test_plan_table_on_tau_bench_err_close_to_por(shared_data, capsys):
    path = shared_data / "tau_bench" / "gpt-4o-airline-even-tasks.json"
    out = json.loads(_run([str(path), "--json"], capsys))
    tot = out["total"]
    # Measured (cl100k, C = 12,047 = half the largest tree): POR 0.250, ERR 0.214.
    assert tot["por"] - tot["err"] < 0.05
    text = _run([str(path), "--ranks", "4"], capsys)
    flat = " ".join(text.split())  # rich wraps lines at the terminal width
    for needle in ("POR 0.", "ERR 0.", "rank", "duplicated tokens", "greedy by token count duplicates"):
        assert needle in flat


def test_plan_capacity_below_a_path_is_a_clear_error(capsys):
    from treecompile.planning.partition import CapacityError

    with pytest.raises(CapacityError, match="fits every path of every tree"):
        _run(["sample:tau_bench", "--tokenizer", "sample", "--capacity", "100"], capsys)


def test_plan_cp_splits_each_row_by_work(capsys, tmp_path):
    out = json.loads(_run(["sample:tau_bench", "--tokenizer", "sample", "--cp", "4", "--cp-align", "64", "--json"],
                          capsys))
    assert out["cp"] == 4 and out["work_model"].startswith("Qwen3-8B")
    for t in out["trees"]:
        assert sum(t["rows"]) == t["tokens"] and len(t["rows"]) == 4
        assert all(b % 64 == 0 for b in t["bounds"][1:-1])
        assert t["imbalance"] <= t["imbalance_by_rows"] + 1e-9 or t["imbalance"] < 1.05
        assert t["kv_bytes_needed"][0] == 0 and max(t["kv_bytes_needed"]) <= max(t["kv_bytes_all_gather"])
        assert max(t["peak_bytes"]) < t["peak_bytes_one_rank"]  # the activations are split
    transformers = pytest.importorskip("transformers")
    from treecompile.planning.budget import CostModel
    from treecompile.distributed.cp_split import RowWork

    config = transformers.Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config.save_pretrained(tmp_path / "qwen3")
    cost = CostModel.from_config(config, dtype="float32", optimizer="sgd", device="cpu")
    mine = json.loads(_run(["sample:tau_bench", "--tokenizer", "sample", "--cp", "2", "--config", str(tmp_path / "qwen3"),
                            "--dtype", "float32", "--optimizer", "sgd", "--device", "cpu", "--json"], capsys))
    assert mine["work_model"].endswith("config.json") and mine["dtype"] == "float32"
    t = mine["trees"][0]
    # The per-rank K/V and peaks are the cost model's of that config (float32: 4 bytes per value).
    per_row = 2 * cost.dims.kv_heads * cost.dims.head_dim * 4
    assert t["kv_bytes_needed"][1] > 0 and all(b % per_row == 0 for b in t["kv_bytes_needed"])
    assert RowWork.from_dims(cost.dims).head > 0 and max(t["peak_bytes"]) > cost.static_bytes()
    text = " ".join(_run(["sample:tau_bench", "--tokenizer", "sample", "--cp", "2"], capsys).split())
    assert "over 2 CP ranks" in text and "all-gather" in text
    with pytest.raises(ValueError, match="give it with --stream"):
        _run(["sample:tau_bench", "--tokenizer", "sample", "--cp", "2", "--budget-bytes", "80e9", "--config",
              str(tmp_path / "qwen3")], capsys)


@pytest.mark.full
def test_plan_cp_with_stream_streams_each_tree_over_the_ranks(capsys, tmp_path):
    """``--cp K --stream MODE --capacity C``: parts of at most K x C rows, each split over the
    ranks (at most C rows each), each rank's predicted peak; a tree whose CP split fits runs
    as one call; with ``--budget-bytes``, parts whose every rank's predicted peak is within
    it; the options it cannot take are refused."""
    argv = ["sample:tau_bench", "--tokenizer", "sample", "--cp", "2", "--stream", "recompute"]
    out = json.loads(_run([*argv, "--capacity", "2000", "--json"], capsys))
    assert out["cp"] == 2 and out["stream"] == "recompute" and out["capacity"] == 2000
    for t in out["trees"]:
        assert t["parts"] >= -(-t["tokens"] // 4000) >= 2 and t["stack_depth"] >= 1
        assert t["rows_per_rank"] <= 2000 and 0 < t["kept_rows"] and len(t["peak_bytes"]) == 2
    whole = json.loads(_run([*argv, "--capacity", "6000", "--json"], capsys))
    assert all(t["parts"] == 1 and t["kept_rows"] == 0 for t in whole["trees"])
    text = " ".join(_run([*argv, "--capacity", "2000"], capsys).split())
    assert "streamed over 2 CP ranks, 2000 rows per rank, recompute mode" in text
    with pytest.raises(ValueError, match="needs --capacity C"):
        _run(argv, capsys)
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    config.save_pretrained(tmp_path / "qwen3")
    step = ["--config", str(tmp_path / "qwen3"), "--dtype", "float32", "--device", "cpu"]
    first = [*step, "--limit", "1"]  # one tree: each budget tried replays the streamed step
    rows = json.loads(_run([*argv, *first, "--capacity", "2000", "--json"], capsys))
    # A budget just under the largest rank's peak at 2000 rows per rank: the tree streams
    # within it, in auto mode too.
    budget = max(max(t["peak_bytes"]) for t in rows["trees"]) - 1
    for mode in ("recompute", "auto"):
        got = json.loads(_run([*argv[:-1], mode, *first, "--budget-bytes", str(budget), "--json"], capsys))
        assert got["budget"]["budget_bytes"] == budget
        for t in got["trees"]:
            assert t["parts"] > 1 and max(t["peak_bytes"]) <= budget and t["mode"] in ("keep", "recompute"), t
    with pytest.raises(ValueError, match="auto chooses the mode by memory"):
        _run([*argv[:-1], "auto", "--capacity", "2000"], capsys)
