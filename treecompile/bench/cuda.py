"""``treecompile bench --device cuda``: tree training against what a user runs today, at real shapes.

    treecompile bench --device cuda                         # Qwen3-0.6B and -1.7B shapes, bf16
    python -m treecompile.bench.cuda --out bench.json       # the same, JSON written after every row

Models: Qwen3-0.6B and Qwen3-1.7B configurations with random weights in bfloat16. Workloads:
synthetic trees of 16 paths at 16k and 32k path tokens and POR 0 / 0.5 / 0.8 / 0.92 (as in
`treecompile.bench.trees`), and the bundled real trees (a tau-bench task, GSM8K groups).

Methods, all on the same model and the same paths, one optimizer-free training step each
(forward + backward):

* ``hf-padded-sdpa``: the unmodified Hugging Face model on the paths as one right-padded batch
  ``[P, L_max]`` with an attention mask, SDPA attention, HF's own loss on labels (padding
  and unmasked tokens ``-100``). On out-of-memory the batch is split into micro-batches
  (gradient accumulation), as a user would; the row says how many.
* ``hf-packed-flex``: the unmodified model on all paths packed into one row, ``position_ids``
  restarting at 0 for each path (HF builds the document mask from them), HF's own
  FlexAttention path, HF's loss with each path's first label ``-100``; on out-of-memory the
  paths go into several packed rows run one after the other, as for the padded baseline.
* ``tree``: `treecompile.tree_compile` on the DFS-packed tree (interval mask, gathered head);
* ``tree-fused``: the same with ``lm_head="fused"`` (the Triton LM-head kernels on CUDA).

The baselines run under ``torch.compile`` (``compile_baselines``), so the tree's speed-up is
not a compiled-versus-eager one. Reported per row: step time (median of ``repeats`` after
``warmup`` steps, the first compiles), path tokens per second, peak memory, speed-up over
each baseline, the FLOP bound ``1 / (1 - POR)`` and the fraction of it reached over
``hf-packed-flex``, and the loss with its relative difference to ``hf-packed-flex``'s.

A time budget (``time_budget_s``) stops starting new measurements once spent; rows not run
say so. On CPU the same code runs with a tiny configuration (tests).

The models and the baselines as a user runs them are in `treecompile.bench.baselines`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from treecompile.bench.compile_stats import PHASES_KEPT, compile_phases, recompile_reasons
from treecompile.bench.baselines import MODEL_SHAPES, Packed, Padded, model_of, paths_of
from treecompile.bench.bound import pair_bounds, work_of
from treecompile.core.errors import UnsupportedModelError
from treecompile.core.interrupt import interrupts_kept, raise_if_interrupted
from treecompile.data.io import write_json, write_text_atomic

__all__ = ["MODEL_SHAPES", "METHODS", "CudaBenchConfig", "DEFAULT", "CudaRow", "run_cuda_bench", "markdown_table",
           "cmd_bench_cuda", "main"]

#: Methods in table order; the first two are the baselines.
METHODS = ("hf-padded-sdpa", "hf-packed-flex", "tree", "tree-fused")
#: The baseline speed-ups and the fraction of the FLOP bound refer to.
REFERENCE = "hf-packed-flex"

# Loss agreement with the packed baseline, relative. bfloat16 keeps 8 mantissa bits: kernels
# that sum in different orders give losses ~1e-3 apart; float32 ~1e-6.
LOSS_RTOL = {"bfloat16": 1e-2, "float32": 1e-4, "float64": 1e-9}


@dataclass(frozen=True)
class CudaBenchConfig:
    """What one run measures (see the module docstring).

    Attributes:
        models: keys of :data:`MODEL_SHAPES`.
        path_tokens: path tokens of the synthetic workloads.
        paths: paths per synthetic tree.
        pors: target POR of each synthetic workload.
        real_data: add the bundled real trees as workloads.
        real_trees: which: ``"all"`` (a tau-bench task and 8 GSM8K groups) or ``"tau"`` (the task alone).
        methods: names from :data:`METHODS`.
        dtype: model dtype.
        warmup, repeats: steps before timing (the first compiles), and timed steps.
        compile_baselines: run the HF baselines under ``torch.compile``.
        baselines: ``"all"`` runs every baseline method on every workload; ``"faster"`` runs both on
            the first workload where both ran and afterwards only the faster of the two (each
            baseline's work depends on the path lengths alone, not on the POR).
        profile_out: a JSON file: the ``tree`` step of the first workload is profiled there
            (`treecompile.bench.profile_cuda.profile_compiled`), reusing its compiled graph,
            and each baseline's step on that workload beside it (key ``"baselines"``).
        packed_attention: HF attention implementation of ``hf-packed-flex`` (``"flex_attention"``;
            ``"sdpa"`` on CPU, where FlexAttention has no backward).
        time_budget_s: start no new measurement after this many seconds.
        seed: model and synthetic tokens.
    """

    # Most informative first: a run stops at its time budget, and at these shapes each method's
    # first step compiles for about 165 s on an H100 (2026-11-24).
    models: tuple[str, ...] = ("qwen3-1.7b", "qwen3-0.6b")
    path_tokens: tuple[int, ...] = (16384, 32768)
    paths: int = 16
    pors: tuple[float, ...] = (0.8, 0.0, 0.5, 0.92)
    real_data: bool = True
    real_trees: str = "all"
    methods: tuple[str, ...] = METHODS
    dtype: str = "bfloat16"
    warmup: int = 2
    repeats: int = 5
    compile_baselines: bool = True
    baselines: str = "all"
    profile_out: str | None = None
    packed_attention: str = "flex_attention"
    time_budget_s: float = 420.0
    seed: int = 0


DEFAULT = CudaBenchConfig()


@dataclass
class CudaRow:
    """One (model, workload, method) measurement, or why there is none (``status``)."""

    model: str
    workload: str
    method: str
    por: float
    path_tokens: int
    rows: int
    status: str = "ok"
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_gib: float | None = None
    first_step_s: float | None = None
    probe_s: float | None = None  # the first-call probe's share of first_step_s (tree methods)
    compiles: int | None = None  # graphs the row compiled (tree methods: treecompile's backend calls)
    recompiles: list[str] = field(default_factory=list)  # Dynamo's reasons, while the row ran
    compile_phases: dict[str, float] = field(default_factory=dict)  # seconds per compile phase (row)
    loss: float | None = None
    loss_rel_diff: float | None = None
    micro_batches: int = 1
    note: str = ""  # e.g. the probe's refusal, when the row was measured with verify=False
    speedup_vs_packed: float | None = None
    speedup_vs_padded: float | None = None
    # The pair-aware bound (`treecompile.bench.bound`), from a baseline's profiled split, if any.
    pair_bound: float | None = None

    @property
    def bound(self) -> float:
        return 1.0 / (1.0 - self.por) if self.por < 1 else float("inf")

    @property
    def bound_fraction(self) -> float | None:
        """Speed-up over the faster baseline that ran, as a fraction of the FLOP bound."""
        ups = [u for u in (self.speedup_vs_packed, self.speedup_vs_padded) if u is not None]
        return min(ups) / self.bound if ups else None

    @property
    def pair_bound_fraction(self) -> float | None:
        """Speed-up over the faster baseline that ran, as a fraction of the pair-aware bound."""
        ups = [u for u in (self.speedup_vs_packed, self.speedup_vs_padded) if u is not None]
        return min(ups) / self.pair_bound if ups and self.pair_bound else None


# ---------------------------------------------------------------------------- workloads


def _workloads(cfg: CudaBenchConfig, vocab: int) -> list[tuple[str, list]]:
    from treecompile.bench import trees as bench

    out = []
    for tokens in cfg.path_tokens:
        for i, por in enumerate(cfg.pors):
            tree = bench.synthetic_tree(cfg.paths, tokens // cfg.paths, por, vocab, cfg.seed + i)
            size = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
            out.append((f"{size} POR {por:g}", [tree]))
    if cfg.real_data:
        real = bench.BenchConfig(pors=(), tau_tasks=1, gsm8k_groups=8 if cfg.real_trees == "all" else 0, vocab=vocab)
        out += bench._workloads(real)
    return out


# ---------------------------------------------------------------------------- methods


class _Tree:
    def __init__(self, compiled, batch):
        self.compiled, self.batch = compiled, batch

    def __call__(self) -> float:
        out = self.compiled(self.batch)
        out.loss.backward()
        return float(out.loss.detach())


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _measure(step, model, cfg: CudaBenchConfig, device: torch.device) -> tuple[float, float, float, float | None]:
    """``(loss, first step s, median step s, peak GiB)``."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(cfg.warmup - 1):
        model.zero_grad(set_to_none=True)
        step()
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(cfg.repeats):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    model.zero_grad(set_to_none=True)
    return loss, first, statistics.median(times), peak


# ---------------------------------------------------------------------------- the run


def run_cuda_bench(cfg: CudaBenchConfig = DEFAULT, *, device: str = "cuda", progress=None, on_row=None,
                   command: str | None = None) -> dict:
    """Runs every method on every workload of every model; returns ``{"env", "config", "rows"}``.

    Args:
        cfg: what to measure.
        device: ``"cuda"`` (the benchmark) or ``"cpu"`` (tests, with a tiny configuration).
        progress: called with a line of text before each measurement, or None.
        on_row: called with the result so far after each row (to write partial results).
        command: the command line to report (default: ``treecompile`` and this process's arguments).

    Raises:
        RuntimeError: ``device="cuda"`` without a CUDA device.
        ValueError: an unknown model or method.
    """
    from treecompile.core.batch import pack
    from treecompile.bench.trees import environment
    from treecompile.compile.wrapper import tree_compile

    bad = [m for m in cfg.models if m not in MODEL_SHAPES] + [m for m in cfg.methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown models or methods {bad}; models: {', '.join(MODEL_SHAPES)}; "
                         f"methods: {', '.join(METHODS)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: treecompile bench --device cuda needs one")
    dtype = getattr(torch, cfg.dtype)
    result: dict[str, Any] = {"env": environment(command), "config": asdict(cfg), "rows": []}
    if cfg.baselines not in ("all", "faster") or cfg.real_trees not in ("all", "tau"):
        raise ValueError(f"baselines must be 'all' or 'faster', real_trees 'all' or 'tau': {cfg}")
    rows: list[CudaRow] = []
    start = time.perf_counter()
    dropped: set[str] = set()  # baselines found slower (cfg.baselines == "faster")
    for model_name in cfg.models:
        model, fns, works = None, {}, []
        for workload, trees in _workloads(cfg, MODEL_SHAPES[model_name]["vocab_size"]):
            if model is None and time.perf_counter() - start <= cfg.time_budget_s:
                model = model_of(model_name, dtype, dev, cfg.seed)
                # One compiled function per method and model, reused by every workload (dynamic shapes).
                fns = {m: _compiled_for(m, model, cfg, tree_compile) for m in cfg.methods}
            stats = [t.stats() for t in trees]
            path_tokens = sum(s.path_tokens for s in stats)
            por = 1.0 - sum(s.tree_tokens for s in stats) / path_tokens
            paths = paths_of(trees)
            batch_rows = {"tree": sum(s.tree_tokens for s in stats), "tree-fused": sum(s.tree_tokens for s in stats),
                          "hf-padded-sdpa": len(paths) * max(len(t) for t, _ in paths),
                          "hf-packed-flex": path_tokens}
            group: list[CudaRow] = []
            for method in cfg.methods:
                row = CudaRow(model_name, workload, method, por, path_tokens, batch_rows[method])
                group.append(row)
                if method in dropped:
                    row.status = "not run: the other baseline was faster on the first workload"
                    continue
                if time.perf_counter() - start > cfg.time_budget_s:
                    row.status = f"not run: time budget {cfg.time_budget_s:.0f} s spent"
                    continue
                if progress is not None:
                    progress(f"{model_name} / {workload}: {method}")
                profiles = result.setdefault("baseline_profiles", {}) if cfg.profile_out and not rows else None
                with recompile_reasons() as reasons:
                    fns[method] = _run_row(row, method, model, fns[method], trees, paths, cfg, dev, pack,
                                           profiles=profiles, path_tokens=path_tokens)
                row.recompiles = ["; ".join(line.strip() for line in r.splitlines()[1:])[:500] for r in reasons]
                if method == "tree" and cfg.profile_out and not result.get("profile") and row.status == "ok":
                    result["profile"] = _profile(fns[method], model, trees, dev, pack, cfg, path_tokens)
                    _save_profiles(result, cfg)
                elif profiles is not None:
                    _save_profiles(result, cfg)
            _relate(group, cfg)
            works.append((group, work_of(trees)))
            _pair_bounds(works, result.get("baseline_profiles") or {} if model_name == cfg.models[0] else {})
            if cfg.baselines == "faster" and not dropped:
                dropped = _slower_baseline(group)
            rows += group
            result["rows"] = [_row_dict(r) for r in rows]
            if on_row is not None:
                on_row(result)
        # The compiled functions hold the model: drop both, and Dynamo's caches, before the next.
        model, fns = None, {}
        torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result["rows"] = [_row_dict(r) for r in rows]
    return result


def _pair_bounds(works: list, profiles: dict) -> None:
    """Each row's pair-aware bound from a baseline's profile of the first model's first workload."""
    bounds = pair_bounds([w for _, w in works], profiles, (REFERENCE, *(m for m in METHODS[:2] if m != REFERENCE)))
    for (group, _), bound in zip(works, bounds):
        for row in group:
            row.pair_bound = bound


def _slower_baseline(group: list[CudaRow]) -> set[str]:
    """The slower of the two baselines, once both have a step time."""
    by = {r.method: r.step_ms for r in group if r.status == "ok" and r.method in METHODS[:2]}
    if len(by) < 2:
        return set()
    return {max(by, key=by.get)}


def _profile(compiled, model, trees, dev, pack, cfg: CudaBenchConfig, path_tokens: int) -> dict:
    """The tree step under the profiler; an error is reported, not raised."""
    from treecompile.bench.profile_cuda import ProfileConfig, profile_compiled

    batch = pack(trees, device=dev, warn_por=False)
    try:
        label = ProfileConfig(model=cfg.models[0], path_tokens=path_tokens, dtype=cfg.dtype, warmup=1)
        report = profile_compiled(compiled, model, batch, label, device=dev, path_tokens=path_tokens)
    except Exception as e:  # the benchmark's rows matter more than the profile
        report = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    return report


def _profile_baseline(step, model, cfg: CudaBenchConfig, dev, rows: int, path_tokens: int | None, method: str) -> dict:
    """A baseline's step under the profiler, reported as the tree's is; an error is reported, not raised."""
    from treecompile.bench.profile_cuda import ProfileConfig, profile_training_step

    try:
        label = ProfileConfig(model=cfg.models[0], path_tokens=path_tokens or rows, dtype=cfg.dtype, warmup=1,
                              method=method)
        return profile_training_step(step, model, label, device=dev, rows=rows, path_tokens=path_tokens)
    except Exception as e:  # the benchmark's rows matter more than the profile
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


def _save_profiles(result: dict, cfg: CudaBenchConfig) -> None:
    """``cfg.profile_out``: the tree step's profile, with the baselines' under ``"baselines"``."""
    write_json(cfg.profile_out, {**(result.get("profile") or {}), "baselines": result.get("baseline_profiles", {})})


def _compiled_for(method: str, model, cfg: CudaBenchConfig, tree_compile):
    if method.startswith("tree"):
        return tree_compile(model, lm_head="fused" if method == "tree-fused" else "gather")
    return torch.compile(model) if cfg.compile_baselines else model


def _run_row(row: CudaRow, method: str, model, fn, trees, paths, cfg, dev, pack, *, profiles: dict | None = None,
             path_tokens: int | None = None):
    """Measures ``row``; returns the compiled function later rows of ``method`` use. With
    ``profiles``, a baseline's step is also profiled there (under its method's name)."""
    given, before = fn, len(getattr(fn, "compile_records", ()))
    phases_before = compile_phases()
    try:
        if method in ("hf-padded-sdpa", "hf-packed-flex"):
            step = (Padded(model, fn, paths, dev) if method == "hf-padded-sdpa"
                    else Packed(model, fn, paths, dev, cfg.packed_attention))
            while True:
                try:
                    measured = _measure(step, model, cfg, dev)
                    break
                except Exception as e:
                    if not _is_oom(e) or step.micro >= len(paths):
                        raise
                    model.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                    step.micro *= 2
            row.micro_batches = step.micro
            if profiles is not None:
                profiles[method] = _profile_baseline(step, model, cfg, dev, row.rows, path_tokens, method)
        else:
            try:
                measured = _measure(_Tree(fn, pack(trees, device=dev, warn_por=False)), model, cfg, dev)
            except UnsupportedModelError as e:
                from treecompile.compile.probe import ProbeRefused

                # A refusal by the first-call probe alone is a finding, and the step still gets
                # measured (the rules proved the graph row-local): with verify=False, said in the row.
                if not isinstance(e, ProbeRefused):
                    raise
                row.note = f"first-call probe refused ({str(e).splitlines()[0][:200]}); measured with verify=False"
                from treecompile.compile.wrapper import tree_compile

                model.zero_grad(set_to_none=True)
                fn = _compiled_for(method, model, cfg, functools.partial(tree_compile, verify=False))
                measured = _measure(_Tree(fn, pack(trees, device=dev, warn_por=False)), model, cfg, dev)
    except Exception as e:  # one failing row never stops the others
        model.zero_grad(set_to_none=True)
        row.status = ("out of memory" if _is_oom(e) else "error") + f": {type(e).__name__}: {str(e)[:300]}"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return fn
    loss, first, step_s, peak = measured
    row.loss, row.first_step_s, row.step_ms, row.peak_gib = loss, first, step_s * 1e3, peak
    spent = {k: v - phases_before.get(k, 0.0) for k, v in compile_phases().items()}
    row.compile_phases = {k: round(v, 2) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])[:PHASES_KEPT]
                          if v >= 0.05}
    if method.startswith("tree"):
        row.probe_s = sum(p.seconds for p in getattr(fn, "probed", ()))
        row.compiles = len(fn.compile_records) - (before if fn is given else 0)
    row.tokens_per_s = row.path_tokens / step_s
    return fn


def _relate(group: list[CudaRow], cfg: CudaBenchConfig) -> None:
    by = {r.method: r for r in group if r.status == "ok"}
    packed, padded = by.get(REFERENCE), by.get("hf-padded-sdpa")
    for r in by.values():
        if packed is not None:
            r.speedup_vs_packed = packed.step_ms / r.step_ms
            r.loss_rel_diff = abs(r.loss - packed.loss) / max(1.0, abs(packed.loss))
        if padded is not None:
            r.speedup_vs_padded = padded.step_ms / r.step_ms
            if packed is None:  # the loss is compared with the baseline that ran
                r.loss_rel_diff = abs(r.loss - padded.loss) / max(1.0, abs(padded.loss))


def _row_dict(r: CudaRow) -> dict[str, Any]:
    return {**asdict(r), "bound": r.bound, "bound_fraction": r.bound_fraction,
            "pair_bound_fraction": r.pair_bound_fraction}


# ---------------------------------------------------------------------------- output

_COLUMNS = ("model", "workload", "POR", "path tok", "rows", "method", "step ms", "path tok/s", "peak GiB",
            "vs packed", "vs padded", "bound", "of bound", "pair bound", "of pair bound", "loss Δrel", "status")


def _fmt(x, spec: str, suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def markdown_table(result: dict) -> str:
    """The rows as a Markdown table, with the environment and configuration above it."""
    e, c = result["env"], result["config"]
    tol = LOSS_RTOL.get(c["dtype"], 1e-4)
    lines = [
        f"- device: {e['device']}; torch {e['torch']}, transformers {e['transformers']}, treecompile "
        f"{e['treecompile']}",
        f"- date: {e['date']}; {c['dtype']}; step = forward + backward, median of {c['repeats']} after "
        f"{c['warmup']} warm-up; baselines compiled: {c['compile_baselines']}",
        "", "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS),
    ]
    for r in result["rows"]:
        diff = r["loss_rel_diff"]
        flag = "" if diff is None or diff <= tol else " MISMATCH"
        status = r["status"] + (f" ({r['micro_batches']} micro-batches)" if r["micro_batches"] > 1 else "")
        status += f"; {r['note']}" if r.get("note") else ""
        lines.append("| " + " | ".join([
            r["model"], r["workload"], f"{r['por']:.3f}", str(r["path_tokens"]), str(r["rows"]), r["method"],
            _fmt(r["step_ms"], ".1f"), _fmt(r["tokens_per_s"], ",.0f"), _fmt(r["peak_gib"], ".2f"),
            _fmt(r["speedup_vs_packed"], ".2f", "x"), _fmt(r["speedup_vs_padded"], ".2f", "x"),
            f"{r['bound']:.2f}x", _fmt(r["bound_fraction"], ".0%"), _fmt(r.get("pair_bound"), ".2f", "x"),
            _fmt(r.get("pair_bound_fraction"), ".0%"), _fmt(diff, ".1e") + flag, status,
        ]) + " |")
    return "\n".join(lines)


def mismatches(result: dict) -> list[str]:
    """Rows whose loss differs from the packed baseline's beyond the dtype's tolerance."""
    tol = LOSS_RTOL.get(result["config"]["dtype"], 1e-4)
    return [f"{r['model']}/{r['workload']}/{r['method']}" for r in result["rows"]
            if r["loss_rel_diff"] is not None and r["loss_rel_diff"] > tol]


def _progress_line(text: str) -> None:
    """A measurement starts: one line on stderr, after any Ctrl-C that the last one swallowed."""
    raise_if_interrupted()
    print(text, file=sys.stderr, flush=True)


def cmd_bench_cuda(args: argparse.Namespace) -> int:
    """``treecompile bench --device cuda``: the common bench options that apply here override
    :data:`DEFAULT` (``--path-tokens``, ``--paths``, ``--por``, ``--repeats``, ``--methods``)."""
    ignored = [flag for flag, on in (("--arch", getattr(args, "arch", None) not in (None, "qwen3")),
                                      ("--tiny", getattr(args, "tiny", False))) if on]
    if ignored:
        print(f"treecompile bench: error: {', '.join(ignored)} do not apply with --device cuda (Qwen3 shapes; "
              "python -m treecompile.bench.cuda --help for its options)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("treecompile bench: error: --device cuda: no CUDA device", file=sys.stderr)
        return 2
    over = {"path_tokens": (args.path_tokens,) if getattr(args, "path_tokens", None) else None,
            "paths": getattr(args, "paths", None), "repeats": getattr(args, "repeats", None),
            "pors": tuple(args.por) if getattr(args, "por", None) else None,
            "methods": tuple(args.methods) if getattr(args, "methods", None) else None}
    cfg = dataclasses.replace(DEFAULT, **{k: v for k, v in over.items() if v is not None})
    out = getattr(args, "out", None)
    result = run_cuda_bench(cfg, progress=_progress_line, on_row=(lambda r: write_json(out, r)) if out else None)
    if out:
        write_json(out, result)
    print(json.dumps(result, indent=2) if getattr(args, "json", False) else markdown_table(result))
    bad = mismatches(result)
    if bad:
        print(f"treecompile bench: loss differs from the packed baseline: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m treecompile.bench.cuda [--out FILE] [--quick] [--device cpu|cuda]``."""
    p = argparse.ArgumentParser(prog="python -m treecompile.bench.cuda", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file, rewritten after every row (partial results survive)")
    p.add_argument("--markdown", default=None, help="Markdown table file, written at the end")
    p.add_argument("--models", nargs="+", default=None, choices=list(MODEL_SHAPES))
    p.add_argument("--path-tokens", type=int, nargs="+", default=None)
    p.add_argument("--por", type=float, nargs="+", default=None)
    p.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                   help="a subset of the methods (default: all)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-real-data", action="store_true")
    p.add_argument("--real-trees", default=None, choices=("all", "tau"),
                   help="the bundled real trees: a tau-bench task and 8 GSM8K groups (all), or the task alone")
    p.add_argument("--baselines", default=None, choices=("all", "faster"),
                   help="faster: after the first workload, only the faster baseline runs")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="profile the first workload's tree step into FILE (JSON), reusing its compiled graph, "
                        "and each baseline's step on that workload (key 'baselines')")
    p.add_argument("--time-budget", type=float, default=None, metavar="S")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    over = {"models": tuple(args.models) if args.models else None,
            "path_tokens": tuple(args.path_tokens) if args.path_tokens else None,
            "pors": tuple(args.por) if args.por else None, "repeats": args.repeats,
            "methods": tuple(args.methods) if args.methods else None,
            "real_data": False if args.no_real_data else None, "time_budget_s": args.time_budget,
            "dtype": args.dtype, "real_trees": args.real_trees, "baselines": args.baselines,
            "profile_out": args.profile}
    cfg = dataclasses.replace(DEFAULT, **{k: v for k, v in over.items() if v is not None})
    if args.device == "cpu":  # FlexAttention has no CPU backward, and compiling baselines on CPU is slow
        cfg = dataclasses.replace(cfg, packed_attention="sdpa", compile_baselines=False)
    elif not torch.cuda.is_available():
        print("bench_cuda: no CUDA device", file=sys.stderr)
        return 2

    def write(result):
        if args.out:  # whole or not at all: Ctrl-C mid-write keeps the previous rows
            write_json(args.out, result)

    logs = "TORCH_LOGS" not in os.environ
    if logs:  # each row keeps the guards that made it compile again
        torch._logging.set_logs(recompiles=True)
    command = " ".join(["python -m treecompile.bench.cuda", *(sys.argv[1:] if argv is None else argv)])
    try:
        with interrupts_kept():
            result = run_cuda_bench(cfg, device=args.device, progress=_progress_line, on_row=write, command=command)
    except KeyboardInterrupt:
        kept = f"; the rows measured so far are in {args.out}" if args.out else ""
        print(f"\nbench_cuda: interrupted{kept}", file=sys.stderr)
        return 130
    finally:
        if logs:
            torch._logging.set_logs()
    write(result)
    table = markdown_table(result)
    if args.markdown:
        write_text_atomic(args.markdown, table + "\n")
    print(table)
    return 1 if mismatches(result) else 0


if __name__ == "__main__":
    raise SystemExit(main())
