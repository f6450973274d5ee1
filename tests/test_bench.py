"""treecompile bench on a seconds-long configuration: every row present, every tree loss exact."""

from __future__ import annotations

import pytest
from testing import eager_default_lowering

from treecompile.bench import trees as bench
from treecompile.cli.main import main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_result():
    # What these tests check (rows, exact losses, the tables) does not depend on the lowering:
    # the default one runs the rewritten graph as it is here (testing.eager_default_lowering).
    with eager_default_lowering():
        return bench.run_bench(bench.TINY, device="cpu", command="pytest")


@pytest.mark.full
def test_every_method_and_workload(tiny_result):
    cfg = bench.TINY
    workloads = [f"synthetic POR {p:g}" for p in cfg.pors] + ["gsm8k 1 groups"]
    got = {(r.workload, r.method) for r in tiny_result.rows}
    assert got == {(w, m) for w in workloads for m in cfg.methods}


@pytest.mark.full
def test_tree_losses_equal_per_path_loss(tiny_result):
    for r in tiny_result.rows:
        assert r.exact, f"{r.workload} / {r.method}: loss differs from per-path by {r.loss_rel_diff:.3g} (relative)"


@pytest.mark.full
def test_synthetic_por_and_rows(tiny_result):
    for r in tiny_result.rows:
        if r.workload.startswith("synthetic"):
            target = float(r.workload.split()[-1])
            assert abs(r.por - target) < 0.05, (r.workload, r.por)
            assert r.path_tokens == bench.TINY.path_tokens
            assert r.rows == (r.path_tokens if r.method == "packed" else round(r.path_tokens * (1 - r.por)))
        assert r.bound == pytest.approx(1 / (1 - r.por))
        assert r.step_ms > 0 and r.tokens_per_s > 0


@pytest.mark.full
def test_table_and_markdown(tiny_result):
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(bench.render_table(tiny_result))
    text = console.export_text()
    md = bench.markdown_table(tiny_result)
    for out in (text, md):
        for m in bench.TINY.methods:
            assert m in out
        for p in bench.TINY.pors:
            assert f"synthetic POR {p:g}" in out
        assert "date:" in out and "command: pytest" in out and "device:" in out


@pytest.mark.parametrize("por", [0.0, 0.2, 0.5, 0.8, 0.92])
def test_synthetic_tree_hits_por(por):
    tree = bench.synthetic_tree(16, 128, por, vocab=2048)
    s = tree.stats()
    assert s.path_tokens == 16 * 128 and s.n_paths == 16
    assert abs(s.por - por) < 0.01, s.por


def test_unknown_method():
    with pytest.raises(ValueError, match="valid methods"):
        bench.run_bench(bench.with_overrides(bench.TINY, methods=("nope",)))


def test_the_help_lists_the_methods_the_bench_takes():
    """``bench --help`` names the methods ``run_bench`` accepts (the help is built without torch)."""
    from treecompile.cli.bench import BENCH_METHODS

    assert BENCH_METHODS == tuple(bench.METHODS)


def test_cli_parses_bench():
    from treecompile.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--tiny", "--por", "0.5", "--methods", "packed", "interval"])
    assert args.tiny and args.por == [0.5] and args.methods == ["packed", "interval"]
    assert main  # the entry point exists; the full run is covered by run_bench above


@pytest.mark.full
def test_hybrid_arch_runs_exactly():
    cfg = bench.with_overrides(bench.TINY, arch="qwen3_next", methods=("packed", "interval"), gsm8k_groups=0, path_tokens=64,
                               pors=(0.5,))
    with eager_default_lowering():  # as tiny_result; test_compile_hybrid lowers Qwen3-Next
        result = bench.run_bench(cfg, device="cpu", command="pytest")
    assert {r.method for r in result.rows} == {"packed", "interval"}
    assert all(r.exact for r in result.rows), [(r.method, r.loss_rel_diff) for r in result.rows]
    assert "Qwen3-Next" in bench.markdown_table(result)
    with pytest.raises(ValueError, match="arch"):
        bench.run_bench(bench.with_overrides(bench.TINY, arch="mamba"), device="cpu")


def _row(method: str, times_ms: list[float]) -> bench.BenchRow:
    import statistics

    step = statistics.median(times_ms)
    return bench.BenchRow(
        workload="w", method=method, por=0.5, path_tokens=64, rows=32, step_ms=step, tokens_per_s=64e3 / step,
        loss=1.0, loss_rel_diff=0.0, exact=True, first_step_s=0.1, step_ms_min=min(times_ms), step_ms_max=max(times_ms),
    )


def _result(rows: list[bench.BenchRow], repeats: int = 3) -> bench.BenchResult:
    base = rows[0]
    for r in rows:
        r.speedup = base.step_ms / r.step_ms
        r.speedup_low = base.step_ms_min / r.step_ms_max
        r.speedup_high = base.step_ms_max / r.step_ms_min
    return bench.BenchResult(rows, bench.with_overrides(bench.TINY, repeats=repeats), bench.environment("pytest"))


def test_a_speedup_inside_the_spread_of_the_repeats_is_flagged():
    packed = _row("packed", [10.0, 11.0, 12.0])
    noisy = _row("interval", [9.5, 10.4, 11.0])  # 1.06x, but 10 / 11 < 1 < 12 / 9.5
    clear = _row("bitmask", [5.0, 5.2, 5.5])  # 2.1x, at least 10 / 5.5 = 1.8x
    result = _result([packed, noisy, clear])
    assert packed.spread == pytest.approx(2 / 11) and noisy.spread == pytest.approx(1.5 / 10.4)
    assert noisy.within_noise and not clear.within_noise and not packed.within_noise
    assert bench.noise_warnings(result) == [
        "w / interval: speedup 1.06x is within the spread of the 3 repeats (packed 10.0-12.0 ms, interval 9.5-11.0 ms: "
        "0.91x to 1.26x); measure on an idle machine or with more --repeats"
    ]
    md = bench.markdown_table(result)
    assert "| 1.06x ~ |" in md and "| 2.12x |" in md and "| 18% |" in md
    assert bench.noise_warnings(_result([_row("packed", [10.0]), _row("interval", [9.0])], repeats=1)) == [
        "one timed step per measurement: no spread measured, the speedups may be noise (--repeats 5 or more)"
    ]


@pytest.mark.full
def test_measured_rows_carry_their_spread(tiny_result):
    for r in tiny_result.rows:
        assert 0 < r.step_ms_min <= r.step_ms <= r.step_ms_max
        assert r.speedup_low <= r.speedup <= r.speedup_high


@pytest.mark.full
def test_the_progress_bar_counts_every_measurement(tiny_result):
    from treecompile.cli.bench import measurements

    assert measurements(bench.TINY) == len(tiny_result.rows)
    # 2 synthetic PORs, the tau-bench tasks asked for (the sample holds 4), one GSM8K workload.
    assert measurements(bench.with_overrides(bench.TINY, tau_tasks=2, methods=("packed",))) == 5
    assert measurements(bench.with_overrides(bench.TINY, tau_tasks=100, methods=("packed",))) == 7


@pytest.mark.full
def test_tests_sharing_the_run_are_one_xdist_group(request, tiny_result):
    # tests/conftest.py groups them, so under `--dist loadgroup` (scripts/test.sh) one worker
    # runs the bench once; the group must be set before pytest-xdist reads it into the node id.
    assert request.node.get_closest_marker("xdist_group").args == ("test_bench:tiny_result",)
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@test_bench:tiny_result"), request.node.nodeid
