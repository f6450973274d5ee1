"""``scripts/gpu.sh run``: a training run in which every optimizer step brings a different tree.

    python -m treecompile.bench.run --out run.json --markdown run.md        # CUDA: Qwen3-1.7B, 8 layers
    python -m treecompile.bench.run --device cpu --out run.json             # the dry run: a tiny model

A benchmark table times one tree again and again; a training run never sees the same tree
twice. Here each of ``steps`` AdamW steps trains on a new workload: a synthetic GRPO group (one
prompt, 4 to 16 completions, prompt and completion lengths drawn per group) or a bundled real
tree (tau-bench and tau2-bench trials, GSM8K groups), so the row count, depth, width and block
layout change at every step. The tree (`treecompile.tree_compile`) and the HF baseline
(`treecompile.bench.baselines`, under ``torch.compile``) each run the same steps on the same
paths, from the same initial weights.

Reported for each: the run's total time with every compile in it, the graphs compiled (the
tree's `compile_records`; Dynamo's frame compiles for the baseline) and Dynamo's recompile
reasons, the percentiles of the step times, the peak memory. And the run's bound: each step's
baseline time divided by that step's pair-aware bound (`treecompile.bench.bound`: attention
counted by its (query, key) pairs, the split of the baseline's step between attention and the
rest from its own profile), summed over the steps; the tree's total over that sum says how near
the run came to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from treecompile.bench.baselines import MODEL_SHAPES, Packed, Padded, model_of, paths_of
from treecompile.bench.bound import AttentionCost, work_of
from treecompile.bench.compile_stats import recompile_reasons
from treecompile.data.io import write_json, write_text_atomic

__all__ = ["RunConfig", "CUDA_RUN", "CPU_RUN", "run_steps", "step_trees", "run_benchmark", "markdown_report", "main"]

#: The baselines (`treecompile.bench.baselines`) by name.
BASELINES = ("hf-packed-flex", "hf-padded-sdpa")


@dataclass(frozen=True)
class RunConfig:
    """What one run trains.

    Attributes:
        model: a key of `treecompile.bench.baselines.MODEL_SHAPES`.
        steps: optimizer steps, each on a new workload.
        dtype: the model's dtype.
        lr: AdamW's learning rate.
        group_sizes: completions per synthetic GRPO group (drawn between the two, inclusive).
        prompt_tokens, completion_tokens: token counts drawn per group (prompt) and per completion.
        real_every: every this many steps, a bundled real tree instead of a synthetic group (0: none).
        real_turns: real conversations cut after this many assistant turns (None: whole).
        baseline: `BASELINES` name.
        packed_attention: the HF attention of ``hf-packed-flex`` (``"sdpa"`` on CPU: no
            FlexAttention backward there).
        compile_baseline: the baseline under ``torch.compile``, with ``baseline_backend`` (None:
            torch's default, inductor; the CPU dry run lowers it as the tree is lowered there,
            ``aot_eager``).
        profile_step: the step (after its first run) at which the baseline's step is profiled
            for the bound's split.
        time_budget_s: a method stops taking steps after this many seconds.
        seed: weights and workloads.
    """

    model: str = "qwen3-1.7b-8l"
    steps: int = 40
    dtype: str = "bfloat16"
    lr: float = 1e-5
    group_sizes: tuple[int, int] = (4, 16)
    prompt_tokens: tuple[int, int] = (256, 2048)
    completion_tokens: tuple[int, int] = (64, 1024)
    real_every: int = 4
    real_turns: int | None = None
    baseline: str = "hf-packed-flex"
    packed_attention: str = "flex_attention"
    compile_baseline: bool = True
    baseline_backend: str | None = None
    profile_step: int = 2
    time_budget_s: float = 240.0
    seed: int = 0


CUDA_RUN = RunConfig()
#: The dry run on a CPU (CI): a tiny model, a few steps, short sequences.
CPU_RUN = RunConfig(model="tiny", steps=8, dtype="float32", group_sizes=(2, 6), prompt_tokens=(8, 64),
                    completion_tokens=(4, 48), real_every=3, real_turns=1, packed_attention="sdpa",
                    baseline_backend="aot_eager", time_budget_s=120.0)


# ---------------------------------------------------------------------------- workloads


def step_trees(cfg: RunConfig, vocab: int) -> list[tuple[str, list]]:
    """``(label, trees)`` for each step: synthetic GRPO groups, and every ``real_every``-th step
    one of the bundled real trees in turn."""
    from treecompile.core.tree import TrajectoryTree

    rng = np.random.default_rng(cfg.seed)
    real = _real_trees(cfg) if cfg.real_every else []
    out: list[tuple[str, list]] = []
    for i in range(cfg.steps):
        if real and (i + 1) % cfg.real_every == 0:
            out.append(real[(i // cfg.real_every) % len(real)])
            continue
        n = int(rng.integers(cfg.group_sizes[0], cfg.group_sizes[1] + 1))
        prompt = rng.integers(1, vocab, int(rng.integers(*cfg.prompt_tokens, endpoint=True))).tolist()
        seqs = [prompt + rng.integers(1, vocab, int(rng.integers(*cfg.completion_tokens, endpoint=True))).tolist()
                for _ in range(n)]
        out.append((f"group of {n}, prompt {len(prompt)}", [TrajectoryTree.from_sequences(seqs)]))
    return out


def _real_trees(cfg: RunConfig) -> list[tuple[str, list]]:
    """The bundled real workloads: each tau-bench task and tau2-bench task (its trials as one
    tree), and GSM8K eight groups of four solutions at a time (a GRPO batch of short answers)."""
    from treecompile.chat.to_tree import tree_from_messages
    from treecompile.chat.tokenizer import load_tokenizer
    from treecompile.data import samples

    tok = load_tokenizer("sample")

    def cut(conv):
        turns = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
        if cfg.real_turns is None or not turns:
            return conv
        return conv[: turns[min(cfg.real_turns, len(turns)) - 1] + 1]

    def tree(convs):
        return tree_from_messages([cut(c) for c in convs], tok, on_drift="ignore")

    out = [(f"tau-bench task {k}", [tree(c)]) for k, c in samples.sample_tau_bench().items()]
    out += [(f"tau2-bench {k}", [tree(c)]) for k, c in samples.sample_think().items()]
    groups = list(samples.sample_gsm8k().values())
    out += [(f"gsm8k groups {i}-{i + 7}", [tree(g) for g in groups[i:i + 8]]) for i in range(0, len(groups) - 7, 8)]
    return out


# ---------------------------------------------------------------------------- one method's run


def _optimizer(model, cfg: RunConfig):
    # foreach=False: one kernel per parameter either way on a CPU; fused where CUDA has it.
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=fused or None, foreach=None if fused else False)


def _frame_compiles() -> int:
    """Frames Dynamo has compiled in this process (its own counter)."""
    return int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))


def run_steps(method: str, cfg: RunConfig, steps: list[tuple[str, list]], device: torch.device) -> dict[str, Any]:
    """Trains a fresh model (``cfg.seed``) with ``method`` (``"tree"`` or a `BASELINES` name) on
    ``steps``; returns its times, compiles, memory and losses (and, for a baseline, the profile
    of one step)."""
    from treecompile.compile.wrapper import tree_compile
    from treecompile.core.batch import pack

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = model_of(cfg.model, getattr(torch, cfg.dtype), device, cfg.seed)
    opt = _optimizer(model, cfg)
    if method == "tree":
        fn = tree_compile(model)
    elif method in BASELINES:
        backend = {} if cfg.baseline_backend is None else {"backend": cfg.baseline_backend}
        fn = torch.compile(model, **backend) if cfg.compile_baseline else model
    else:
        raise ValueError(f"unknown method {method!r}; valid: tree, {', '.join(BASELINES)}")

    def graphs() -> int:  # the tree's compile records; Dynamo's frame compiles for a baseline
        return len(fn.compile_records) if method == "tree" else _frame_compiles()

    graphs_before = graphs()
    times, losses, labels, compiled_at, profile = [], [], [], [], None
    start = time.perf_counter()
    with recompile_reasons() as reasons:
        for i, (label, trees) in enumerate(steps):
            if time.perf_counter() - start > cfg.time_budget_s:
                break
            before = graphs()
            if method == "tree":
                batch = pack(trees, device=device, warn_por=False)

                def step(batch=batch):
                    out = fn(batch)
                    out.loss.backward()
                    return float(out.loss.detach())
            else:
                paths = paths_of(trees)
                step = (Padded(model, fn, paths, device) if method == "hf-padded-sdpa"
                         else Packed(model, fn, paths, device, cfg.packed_attention))
            sync()
            t0 = time.perf_counter()
            loss = step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            labels.append(label)
            if graphs() > before:
                compiled_at.append(i)
            if method != "tree" and i == cfg.profile_step:
                profile = _profile(step, model, device, trees)
    wall = time.perf_counter() - start
    compiles = graphs() - graphs_before
    result = {
        "method": method,
        "steps": len(times),
        "total_s": sum(times),
        "wall_s": wall,
        "step_s": times,
        "labels": labels,
        "losses": losses,
        "compiles": compiles,
        "compiled_at_steps": compiled_at,
        "recompile_reasons": ["; ".join(line.strip() for line in r.splitlines()[1:])[:400] for r in reasons],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "percentiles_ms": _percentiles(times, compiled_at),
    }
    if profile is not None:
        result["profile"] = profile
    return result


def _profile(step, model, device: torch.device, trees) -> dict[str, Any]:
    """One more step of the baseline under the profiler (its split between attention and the
    rest); an error is reported, not raised."""
    from treecompile.bench.profile_cuda import ProfileConfig, profile_training_step

    work = work_of(trees)
    try:
        report = profile_training_step(step, model, ProfileConfig(warmup=1, steps=1), device=device,
                                       rows=work.path_tokens, path_tokens=work.path_tokens)
    except Exception as e:  # the run's times matter more than the split
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    model.zero_grad(set_to_none=True)
    return {"categories_ms": report["categories_ms"], "work": asdict(work)}


def _percentiles(times: list[float], compiled_at: list[int]) -> dict[str, float | None]:
    """p50, p90 and max of the step times in ms, over every step and over the steps that compiled nothing."""
    steady = [t for i, t in enumerate(times) if i not in compiled_at]

    def pct(xs, q):
        return None if not xs else 1e3 * float(np.percentile(xs, q))

    return {"p50": pct(times, 50), "p90": pct(times, 90), "max": pct(times, 100),
            "steady_p50": pct(steady, 50), "steady_p90": pct(steady, 90)}


# ---------------------------------------------------------------------------- the benchmark


def run_benchmark(cfg: RunConfig = CUDA_RUN, *, device: str = "cuda", command: str | None = None,
                  progress=None) -> dict[str, Any]:
    """The tree's run and the baseline's on the same steps; ``{"env", "config", "steps", "tree",
    "baseline", "bound"}``.

    Raises:
        RuntimeError: ``device="cuda"`` without a CUDA device.
        ValueError: an unknown model or baseline.
    """
    from treecompile.bench.trees import environment

    if cfg.model not in MODEL_SHAPES or cfg.baseline not in BASELINES:
        raise ValueError(f"unknown model {cfg.model!r} or baseline {cfg.baseline!r}; models: {', '.join(MODEL_SHAPES)}; "
                         f"baselines: {', '.join(BASELINES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: python -m treecompile.bench.run needs one (or --device cpu)")
    steps = step_trees(cfg, MODEL_SHAPES[cfg.model]["vocab_size"])
    works = [work_of(trees) for _, trees in steps]
    result: dict[str, Any] = {
        "env": environment(command if command is not None else " ".join(["python -m treecompile.bench.run", *sys.argv[1:]])),
        "config": asdict(cfg),
        "steps": [{"label": label, **asdict(w), "por": 1 - w.tree_tokens / w.path_tokens} for (label, _), w in
                  zip(steps, works)],
    }
    for key, method in (("tree", "tree"), ("baseline", cfg.baseline)):
        if progress is not None:
            progress(f"{method}: {len(steps)} steps")
        result[key] = run_steps(method, cfg, steps, dev)
    result["bound"] = _bound(result, works)
    return result


def _bound(result: dict[str, Any], works: list) -> dict[str, Any]:
    """The run's pair-aware bound: each step's baseline time over that step's bound, summed over
    the steps both methods ran; and the tree's total over it."""
    base, tree = result["baseline"], result["tree"]
    profile = base.get("profile") or {}
    if "categories_ms" not in profile:
        return {"error": "the baseline's step was not profiled: " + profile.get("error", "too few steps")}
    from treecompile.bench.bound import Work

    cost = AttentionCost.from_profile(profile["categories_ms"], Work(**profile["work"]))
    n = min(base["steps"], tree["steps"])
    bounds = [cost.bound(w) for w in works[:n]]
    ideal = [t / b for t, b in zip(base["step_s"][:n], bounds)]
    steady = [i for i in range(n) if i not in base["compiled_at_steps"] and i not in tree["compiled_at_steps"]]
    tree_total, tree_steady = sum(tree["step_s"][:n]), sum(tree["step_s"][i] for i in steady)
    ideal_steady = sum(ideal[i] for i in steady)
    return {
        "cost": cost.as_dict(),
        "attention_share": [cost.share(w) for w in works[:n]],
        "step_bounds": bounds,
        "token_bounds": [w.token_bound for w in works[:n]],
        "run_bound_s": sum(ideal),
        "tree_total_s": tree_total,
        "tree_over_bound": tree_total / sum(ideal),
        "speedup": sum(base["step_s"][:n]) / tree_total,
        # Without the steps where either side compiled: the run's steady state.
        "steady_steps": len(steady),
        "steady_tree_over_bound": tree_steady / ideal_steady if ideal_steady else None,
        "steady_speedup": sum(base["step_s"][i] for i in steady) / tree_steady if tree_steady else None,
    }


def markdown_report(result: dict[str, Any]) -> str:
    """The run as Markdown: each method's totals, and the bound."""
    env, cfg = result["env"], result["config"]
    lines = [f"# A training run: {result['tree']['steps']} steps, a new tree each", "",
             f"{env['device']}; torch {env['torch']}, transformers {env['transformers']}; {env['date']}; "
             f"`{env['command']}`", "",
             f"Model `{cfg['model']}` in {cfg['dtype']}, AdamW; steps: synthetic groups of {cfg['group_sizes'][0]}-"
             f"{cfg['group_sizes'][1]} completions, one step in {cfg['real_every']} a bundled real tree "
             f"(rows {min(s['tree_tokens'] for s in result['steps'])}-{max(s['tree_tokens'] for s in result['steps'])}).",
             "", "| method | steps | total s (compiles in) | graphs compiled | at steps | p50 ms | p90 ms | max ms | "
             "steady p50 ms | peak GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key in ("tree", "baseline"):
        r = result[key]
        p = r["percentiles_ms"]
        cells = [r["method"], r["steps"], f"{r['total_s']:.2f}", r["compiles"], ", ".join(map(str, r["compiled_at_steps"])),
                 *(_num(p[k]) for k in ("p50", "p90", "max", "steady_p50")), _num(r["peak_gib"], ".2f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    b = result["bound"]
    lines.append("")
    if "error" in b:
        lines.append(f"Bound: {b['error']}")
    else:
        lines += [f"Run's pair-aware bound {b['run_bound_s']:.2f} s; the tree's total {b['tree_total_s']:.2f} s is "
                  f"{b['tree_over_bound']:.2f}x of it (speed-up over the baseline {b['speedup']:.2f}x); "
                  f"over the {b['steady_steps']} steps where neither compiled: {_num(b['steady_tree_over_bound'], '.2f')}x "
                  f"of the bound, speed-up {_num(b['steady_speedup'], '.2f')}x."]
    for key in ("tree", "baseline"):
        for reason in result[key]["recompile_reasons"]:
            lines.append(f"- {result[key]['method']} recompiled: {reason}")
    return "\n".join(lines) + "\n"


def _num(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=None, help="JSON report")
    p.add_argument("--markdown", default=None, help="Markdown report")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--model", default=None, choices=sorted(MODEL_SHAPES))
    p.add_argument("--baseline", default=None, choices=BASELINES)
    p.add_argument("--time-budget", type=float, default=None, help="seconds per method")
    args = p.parse_args(argv)
    cfg = CUDA_RUN if args.device == "cuda" else CPU_RUN
    over = {k: v for k, v in (("steps", args.steps), ("model", args.model), ("baseline", args.baseline),
                              ("time_budget_s", args.time_budget)) if v is not None}
    cfg = dataclasses.replace(cfg, **over)
    torch._logging.set_logs(recompiles=True)  # what recompile_reasons collects
    result = run_benchmark(cfg, device=args.device, progress=lambda s: print(f"[run] {s}", file=sys.stderr, flush=True))
    text = markdown_report(result)
    if args.out:
        write_json(args.out, result)
    if args.markdown:
        write_text_atomic(args.markdown, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
