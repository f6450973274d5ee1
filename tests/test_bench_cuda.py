"""treecompile/bench/cuda.py end to end on the CPU with a tiny model (the GPU run uses Qwen3 shapes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from testing import TOLERANCES, assert_grads_close, eager_default_lowering

from treecompile.bench import cuda as bench_cuda
from treecompile.bench import baselines as bench_baselines
from treecompile.cli.main import main as cli_main

pytest.importorskip("transformers")


@pytest.mark.full
def test_all_methods_run_and_agree_on_the_loss(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    # The rows' making is tested here, not the lowering (test_compile_hf lowers tiny Qwen3).
    with eager_default_lowering():
        rc = bench_cuda.main(["--device", "cpu", "--models", "tiny", "--path-tokens", "96", "--por", "0.5",
                              "--repeats", "1", "--no-real-data", "--dtype", "float32", "--out", str(out),
                              "--markdown", str(md), "--profile", str(tmp_path / "profile.json")])
    assert rc == 0
    # The tree step profiled in the same process, on the workload's own batch.
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert "error" not in profile and profile["path_tokens"] == 96 and profile["compiles_during_profile"] == 0
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    # ... and each baseline's step beside it, on its own rows
    assert set(profile["baselines"]) == {"hf-padded-sdpa", "hf-packed-flex"}
    for method, report in profile["baselines"].items():
        assert "error" not in report and report["rows"] == rows[method]["rows"] and report["path_tokens"] == 96
        assert report["config"]["method"] == method and report["categories_ms"]
    # every tree row says how many graphs its first step compiled (the first: one)
    assert rows["tree"]["compiles"] == 1 and rows["tree-fused"]["compiles"] >= 1 and rows["hf-packed-flex"]["compiles"] is None
    # ... and where its compile time went (Dynamo's frame compile holds the rest)
    assert 0 < rows["tree"]["compile_phases"]["_compile.compile_inner"] <= rows["tree"]["first_step_s"]
    assert list(rows) == list(bench_cuda.METHODS)
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["loss_rel_diff"] <= bench_cuda.LOSS_RTOL["float32"], r
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["speedup_vs_packed"] > 0
    assert rows["tree"]["rows"] < rows["hf-packed-flex"]["rows"] == rows["tree"]["path_tokens"]
    assert rows["tree"]["bound"] == pytest.approx(1 / (1 - rows["tree"]["por"]))
    # The pair-aware bound, from the profiled baseline's split: between the pairs' and the tokens' bounds.
    from treecompile.bench.bound import AttentionCost, Work

    work = Work(**{k: v for k, v in _work_of_first(result).items()})
    cost = AttentionCost.from_profile(profile["baselines"]["hf-packed-flex"]["categories_ms"], work)
    assert rows["tree"]["pair_bound"] == pytest.approx(cost.bound(work))
    assert work.pair_ratio <= rows["tree"]["pair_bound"] <= rows["tree"]["bound"] + 1e-9
    assert rows["tree"]["pair_bound_fraction"] == pytest.approx(
        min(rows["tree"]["speedup_vs_packed"], rows["tree"]["speedup_vs_padded"]) / rows["tree"]["pair_bound"])
    assert rows["hf-packed-flex"]["speedup_vs_packed"] == 1.0
    assert "| tiny | 96 POR 0.5 |" in md.read_text()


def _work_of_first(result: dict) -> dict:
    """The first workload's token and pair counts, rebuilt from the run's configuration."""
    from treecompile.bench.bound import work_of

    cfg = bench_cuda.CudaBenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in result["config"].items()})
    _, trees = bench_cuda._workloads(cfg, bench_baselines.MODEL_SHAPES[cfg.models[0]]["vocab_size"])[0]
    return dataclasses.asdict(work_of(trees))


def test_only_the_faster_baseline_runs_after_the_first_workload(monkeypatch):
    """``baselines="faster"``: both baselines run on the first workload, then only the faster."""
    ran = []

    def fake_row(row, method, model, fn, *args, **kwargs):
        ran.append((row.workload, method))
        row.step_ms, row.loss, row.tokens_per_s = {"hf-padded-sdpa": 9.0, "hf-packed-flex": 5.0}.get(method, 1.0), 1.0, 1.0
        return fn

    monkeypatch.setattr(bench_cuda, "_run_row", fake_row)
    monkeypatch.setattr(bench_cuda, "_compiled_for", lambda *args: None)
    cfg = dataclasses.replace(bench_cuda.DEFAULT, models=("tiny",), path_tokens=(64,), pors=(0.5, 0.0),
                              real_data=False, baselines="faster")
    result = bench_cuda.run_cuda_bench(cfg, device="cpu")
    first, second = (w for w in dict.fromkeys(r["workload"] for r in result["rows"]))
    assert [m for w, m in ran if w == first] == list(bench_cuda.METHODS)
    assert [m for w, m in ran if w == second] == ["hf-packed-flex", "tree", "tree-fused"]
    skipped = [r for r in result["rows"] if r["workload"] == second and r["method"] == "hf-padded-sdpa"]
    assert skipped[0]["status"].startswith("not run: the other baseline was faster")


def test_time_budget_marks_rows_not_run():
    cfg = dataclasses.replace(bench_cuda.DEFAULT, models=("tiny",), path_tokens=(64,), pors=(0.0,), real_data=False,
                              time_budget_s=0.0)
    result = bench_cuda.run_cuda_bench(cfg, device="cpu")
    assert [r["status"].split(":")[0] for r in result["rows"]] == ["not run"] * len(bench_cuda.METHODS)
    assert "not run" in bench_cuda.markdown_table(result)


def test_methods_option_runs_only_those_methods(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_cuda.main(["--device", "cpu", "--models", "tiny", "--path-tokens", "64", "--por", "0",
                            "--no-real-data", "--methods", "hf-padded-sdpa", "tree", "--time-budget", "0",
                            "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["method"] for r in result["rows"]] == ["hf-padded-sdpa", "tree"]
    assert result["env"]["command"].startswith("python -m treecompile.bench.cuda --device cpu --models tiny")


@pytest.mark.parametrize("method", ["hf-padded-sdpa", "hf-packed-flex"])
def test_baseline_micro_batches_give_the_one_batch_step(method):
    """The baselines' fallback on out-of-memory (gradient accumulation over micro-batches of
    paths) trains the same step: the token-mean loss and every gradient, float64."""
    from treecompile.bench.trees import synthetic_tree

    model = bench_baselines.model_of("tiny", torch.float64, torch.device("cpu"), 0)
    paths = bench_baselines.paths_of([synthetic_tree(5, 24, 0.5, 2048, 0)])
    paths[1] = (paths[1][0], [False] * 7 + paths[1][1][7:])  # micro-batches of different target counts

    def step(micro):
        model.zero_grad(set_to_none=True)
        runner = (bench_baselines.Padded(model, model, paths, torch.device("cpu")) if method == "hf-padded-sdpa"
                  else bench_baselines.Packed(model, model, paths, torch.device("cpu"), "sdpa"))
        runner.micro = micro
        return runner(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = step(1)
    # HF's norms compute in float32 inside the float64 model: its noise floor, not rounding.
    rtol, _ = TOLERANCES[("float64", "hf")]
    for micro in (2, 3):
        loss_m, grads_m = step(micro)
        assert loss_m == pytest.approx(loss, rel=rtol)
        assert_grads_close(grads_m, grads, ("float64", "hf"))


def test_baseline_inputs_are_built_once_outside_the_timed_steps(monkeypatch):
    """The tree's batch is packed once before its steps; the baselines' input tensors too (the
    first, untimed step builds them), else the baselines' times would include host work the
    tree's do not."""
    from treecompile.bench.trees import synthetic_tree

    model = bench_baselines.model_of("tiny", torch.float32, torch.device("cpu"), 0)
    paths = bench_baselines.paths_of([synthetic_tree(4, 16, 0.5, 2048, 0)])
    built = []
    for cls in (bench_baselines.Padded, bench_baselines.Packed):
        counted = lambda self, part, f=cls._call_kwargs: built.append(1) or f(self, part)  # noqa: E731
        monkeypatch.setattr(cls, "_call_kwargs", counted)
    cfg = dataclasses.replace(bench_cuda.DEFAULT, warmup=2, repeats=3)
    for step in (bench_baselines.Padded(model, model, paths, torch.device("cpu")),
                 bench_baselines.Packed(model, model, paths, torch.device("cpu"), "sdpa")):
        built.clear()
        bench_cuda._measure(step, model, cfg, torch.device("cpu"))
        assert len(built) == 1
        step.micro = 2  # after an out-of-memory: built again, once, for the new micro-batches
        built.clear()
        bench_cuda._measure(step, model, cfg, torch.device("cpu"))
        assert len(built) == 2


def _row(method: str, step_ms: float, loss: float) -> bench_cuda.CudaRow:
    return bench_cuda.CudaRow(model="m", workload="w", method=method, por=0.8, path_tokens=100, rows=20,
                              step_ms=step_ms, loss=loss)


def test_fraction_of_the_bound_is_over_the_faster_baseline():
    padded, packed = _row("hf-padded-sdpa", 800.0, 2.0), _row("hf-packed-flex", 1000.0, 2.0)
    tree = _row("tree", 200.0, 2.0)
    bench_cuda._relate([padded, packed, tree], bench_cuda.DEFAULT)
    assert tree.speedup_vs_padded == 4.0 and tree.speedup_vs_packed == 5.0
    assert tree.bound_fraction == pytest.approx(4.0 / 5.0)
    # Without the packed baseline (out of memory, or not asked for): the padded one, loss included.
    padded, tree = _row("hf-padded-sdpa", 800.0, 2.0), _row("tree", 160.0, 2.004)
    bench_cuda._relate([padded, tree], bench_cuda.DEFAULT)
    assert tree.bound_fraction == pytest.approx(1.0) and tree.loss_rel_diff == pytest.approx(0.002)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="models: qwen3-0.6b"):
        bench_cuda.run_cuda_bench(dataclasses.replace(bench_cuda.DEFAULT, models=("qwen9",)), device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_cli_bench_device_cuda_without_cuda_exits_2(capsys):
    assert cli_main(["bench", "--device", "cuda"]) == 2
    assert "no CUDA" in capsys.readouterr().err


def test_cpu_bench_flags_are_refused_with_device_cuda(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the no-CUDA check, to the flags
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli_main(["bench", "--device", "cuda", "--arch", "qwen3_next"]) == 2
    assert "--arch do not apply with --device cuda" in capsys.readouterr().err


@pytest.mark.full
def test_a_probe_refusal_is_reported_and_the_step_measured_without_the_probe(monkeypatch):
    """The benchmark keeps measuring a model the first-call probe refuses (the rules proved it),
    says so in the row, and reuses the unverified wrapper for the later workloads."""
    import treecompile.compile.probe as probe

    def refuse(*args):
        raise probe.ProbeRefused("the first-call probe found a difference (planted by the test)")

    monkeypatch.setattr(probe, "probe_graph", refuse)
    cfg = dataclasses.replace(bench_cuda.DEFAULT, models=("tiny",), path_tokens=(64,), pors=(0.5, 0.0),
                              real_data=False, methods=("tree",), repeats=1, warmup=1)
    with eager_default_lowering():
        result = bench_cuda.run_cuda_bench(cfg, device="cpu")
    rows = result["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    assert rows[0]["note"].startswith("first-call probe refused (the first-call probe found a difference")
    assert rows[1]["note"] == ""  # the second workload ran on the wrapper compiled with verify=False


def test_recompile_reasons_keep_the_failed_guard():
    from treecompile.bench.compile_stats import recompile_reasons

    f = torch.compile(lambda x: x * 2, dynamic=False, backend="eager")
    torch._logging.set_logs(recompiles=True)
    try:
        with recompile_reasons() as reasons:
            f(torch.ones(3))
            f(torch.ones(4))  # a static size guard fails
    finally:
        torch._logging.set_logs()
    assert len(reasons) == 1 and "size mismatch" in reasons[0] and "expected 3, actual 4" in reasons[0]
