"""One tree training step under ``torch.profiler``: where its time goes, by kind of work.

    python -m treecompile.bench.profile_cuda --out profile.json --markdown profile.md
    scripts/gpu.sh profile --out DIR

Defaults: a Qwen3-1.7B-shaped model (random weights, bfloat16), one synthetic tree of 16 paths
with 32k path tokens at POR 0.8 (`treecompile.bench.trees.synthetic_tree`), ``tree_compile`` with
its defaults. After warm-up steps (the first compiles), ``steps`` steps (forward, backward)
run under the profiler, each ended by a device synchronisation.

Reported per step: the wall time; the device's busy time (the union of its kernels'
intervals) and the rest of the wall time (host work, launch gaps, synchronisations); the
device time per category of kernel, by name (:data:`CATEGORIES`, first match wins; Inductor
names its kernels after the operations they fuse); the top kernels by device time, so that
nothing hides in "other"; the compiles and host synchronisations during the profiled steps.

On a CPU (``--device cpu``, for tests) the same runs on a tiny model, and the categories
classify the operators' own CPU time instead of kernels (an operator inside a treecompile
op, such as the CPU tree attention, counts as that op).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treecompile.data.io import write_json, write_text_atomic

__all__ = ["CATEGORIES", "GAP_CLASSES", "ProfileConfig", "profile_step", "profile_compiled", "profile_training_step",
           "markdown_report", "gap_classes", "host_syncs", "main"]

#: ``(category, regular expression on the kernel or operator name)``, first match wins.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention backward", r"flex_attention_backward|flash.*bwd|fmha.*bwd|attention_cpu_backward|attention_backward"),
    ("attention forward", r"flex_attention|flash.*fwd|fmha|tree_attention|prefix_tree_attention|sdpa|attention"),
    # The fused head's Triton kernels (kernels/logprobs/fused_triton.py) and the gathered head's ops.
    ("LM head log-probs", r"logprobs|_row_grad_kernel|log_softmax|cross_entropy|nll_loss"),
    ("matmuls", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|\bmm\b|_mm_|aten::mm|aten::addmm|aten::bmm|aten::matmul|"
                r"aten::linear|triton_tem_fused_(addmm|mm|bmm)"),
    ("block mask / tree tables", r"block_mask|blockmask|tree_tables|interval|searchsorted|cumsum|bincount"),
    ("copies and fills", r"memcpy|memset|copy|fill|cat\b|aten::cat|to_copy|clone|zero_"),
    ("normalisation, activations and other fused kernels", r"^triton_(poi|red|per)|rms|norm|silu|gelu|rotary|"
                                                           r"elementwise|reduce|aten::"),
)


@dataclass(frozen=True)
class ProfileConfig:
    """What one profile runs.

    Attributes:
        model: a key of `treecompile.bench.baselines.MODEL_SHAPES`.
        path_tokens, paths, por: the synthetic tree.
        dtype: the model's dtype.
        lm_head: ``tree_compile(lm_head=...)``.
        warmup, steps: steps before profiling (the first compiles), and profiled steps.
        top: kernels listed by name.
        seed: model and tokens.
        method: what the profiled step runs (a label: ``"tree"``, or a baseline's name).
    """

    model: str = "qwen3-1.7b"
    path_tokens: int = 32768
    paths: int = 16
    por: float = 0.8
    dtype: str = "bfloat16"
    lm_head: str = "gather"
    warmup: int = 2
    steps: int = 3
    top: int = 15
    seed: int = 0
    method: str = "tree"


def _category(name: str) -> str:
    low = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, low):
            return category
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


#: Idle stretches between device kernels, by length: back-to-back launches, launch-bound
#: stretches, and the host holding the device (Python, the autograd runtime, a sync).
GAP_CLASSES = (("under 20 us", 20.0), ("20 us to 1 ms", 1000.0), ("over 1 ms", float("inf")))


def gap_classes(intervals: list[tuple[float, float]]) -> dict[str, float]:
    """The idle time between the union of ``(start, end)`` intervals (microseconds), summed
    per :data:`GAP_CLASSES` class of gap length."""
    out = {name: 0.0 for name, _ in GAP_CLASSES}
    end = None
    for s, e in sorted(intervals):
        if end is not None and s > end:
            gap = s - end
            out[next(name for name, top in GAP_CLASSES if gap < top)] += gap
        end = e if end is None else max(end, e)
    return out


def host_syncs(step) -> list[str]:
    """The host synchronisations ``step()`` makes on CUDA, one line each
    (``torch.cuda.set_sync_debug_mode``): ``"FILE:LINE: message"``, where FILE:LINE is the
    Python line that made it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sync_lines(caught)


def sync_lines(caught: list[warnings.WarningMessage]) -> list[str]:
    """The synchronisation warnings among ``caught``, as ``"FILE:LINE: first line of the message"``."""
    return [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in caught
            if "synchroniz" in str(w.message)]


def sync_sites(lines: list[str]) -> list[tuple[str, int]]:
    """``(FILE:LINE, count)`` of `host_syncs`'s lines, most frequent first."""
    return Counter(line.split(": ", 1)[0] for line in lines).most_common()


def profile_step(cfg: ProfileConfig = ProfileConfig(), *, device: str = "cuda") -> dict[str, Any]:
    """Profiles ``cfg.steps`` tree training steps; returns the report as a dict (see the module docstring).

    Raises:
        RuntimeError: ``device="cuda"`` without a CUDA device.
    """
    from treecompile.core.batch import pack
    from treecompile.bench.trees import synthetic_tree
    from treecompile.bench.baselines import MODEL_SHAPES, model_of
    from treecompile.compile.wrapper import tree_compile

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: python -m treecompile.bench.profile_cuda needs one (or --device cpu)")
    if cfg.model not in MODEL_SHAPES:
        raise ValueError(f"unknown model {cfg.model!r}; models: {', '.join(MODEL_SHAPES)}")
    vocab = MODEL_SHAPES[cfg.model]["vocab_size"]
    tree = synthetic_tree(cfg.paths, cfg.path_tokens // cfg.paths, cfg.por, vocab, cfg.seed)
    model = model_of(cfg.model, getattr(torch, cfg.dtype), dev, cfg.seed)
    compiled = tree_compile(model, lm_head=cfg.lm_head)
    batch = pack(tree, device=dev, warn_por=False)
    return profile_compiled(compiled, model, batch, cfg, device=dev, path_tokens=tree.stats().path_tokens)


def profile_compiled(compiled, model, batch, cfg: ProfileConfig = ProfileConfig(), *,
                     device: torch.device | str = "cuda", path_tokens: int | None = None) -> dict[str, Any]:
    """Profiles ``cfg.steps`` training steps of ``compiled`` (a `tree_compile` result on
    ``model``) on ``batch``; what `profile_step` reports, after ``cfg.warmup`` unprofiled steps
    (the first may compile). ``cfg``'s model and tree fields only label the report, and
    ``path_tokens`` (the paths' total length) gives its POR."""

    def step():
        out = compiled(batch)
        out.loss.backward()

    return profile_training_step(step, model, cfg, device=device, rows=batch.num_tokens, path_tokens=path_tokens,
                                 compiles=lambda: len(compiled.compile_records))


def profile_training_step(step: Callable[[], Any], model, cfg: ProfileConfig = ProfileConfig(), *,
                          device: torch.device | str = "cuda", rows: int, path_tokens: int | None = None,
                          compiles: Callable[[], int] = lambda: 0) -> dict[str, Any]:
    """Profiles ``cfg.steps`` calls of ``step()`` (one forward and backward of ``model``, which
    gets ``zero_grad`` before each, and a device synchronisation after) after ``cfg.warmup``
    unprofiled ones: the tree's step or a baseline's, reported alike. ``rows`` is the step's
    row count, ``compiles()`` the number of compiles so far (for the count during the profile)."""
    from torch.profiler import ProfilerActivity, profile

    from treecompile.bench.trees import environment

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    inner = step

    def step():
        model.zero_grad(set_to_none=True)
        inner()
        sync()

    t0 = time.perf_counter()
    step()
    first_s = time.perf_counter() - t0
    for _ in range(cfg.warmup - 1):
        step()
    compiles_before = compiles()
    sync_list = host_syncs(step) if cuda else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(cfg.steps):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
    compiled_during = compiles() - compiles_before

    by_name: dict[str, float] = {}
    intervals = []
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                us = e.time_range.elapsed_us()
                by_name[e.name] = by_name.get(e.name, 0.0) + us
                intervals.append((e.time_range.start, e.time_range.end))
        busy_us = _union_us(intervals)
        gaps = gap_classes(intervals)
    else:
        # An operator's own time counts under its outermost treecompile:: op, if any (the CPU
        # attention ops run their work as aten ops inside them).
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CPU or e.self_cpu_time_total <= 0:
                continue
            name, up = e.name, e.cpu_parent
            while up is not None:
                if up.name.startswith("treecompile::"):
                    name = up.name
                up = up.cpu_parent
            by_name[name] = by_name.get(name, 0.0) + e.self_cpu_time_total
        busy_us = sum(by_name.values())
        gaps = None
    n = cfg.steps
    categories: dict[str, float] = {}
    for name, us in by_name.items():
        c = _category(name)
        categories[c] = categories.get(c, 0.0) + us
    wall_ms = 1e3 * sum(walls) / n
    busy_ms = busy_us / 1e3 / n
    return {
        "env": environment("python -m treecompile.bench.profile_cuda"),
        "config": dataclasses.asdict(cfg),
        "device": dev.type,
        "rows": rows,
        "path_tokens": path_tokens,
        "por": None if not path_tokens else 1.0 - rows / path_tokens,
        "first_step_s": first_s,
        "step_wall_ms": wall_ms,
        "busy_ms": busy_ms,
        "busy_what": "device kernels (union of intervals)" if cuda else "operators' own CPU time",
        "not_busy_ms": max(0.0, wall_ms - busy_ms) if cuda else None,
        "device_ops_per_step": len(intervals) / n if cuda else None,
        "gaps_ms": None if gaps is None else {k: us / 1e3 / n for k, us in gaps.items()},
        "categories_ms": {c: us / 1e3 / n for c, us in sorted(categories.items(), key=lambda kv: -kv[1])},
        "top": [(name, us / 1e3 / n) for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:cfg.top]],
        "compiles_during_profile": compiled_during,
        "host_syncs_per_step": None if sync_list is None else len(sync_list),
        "host_sync_sites": None if sync_list is None else sync_sites(sync_list),
    }


def markdown_report(r: dict[str, Any]) -> str:
    """The report as Markdown: the step's totals, the categories and the top kernels."""
    env, cfg = r["env"], r["config"]
    summed = sum(r["categories_ms"].values())
    method = cfg.get("method", "tree")
    head = f", lm_head={cfg['lm_head']!r}" if method.startswith("tree") else ""
    lines = [
        f"Profile of one {method} training step: {cfg['model']}, {cfg['dtype']}, {r['rows']} rows for "
        f"{r['path_tokens']} path tokens (POR {r['por']:.2f}){head}; mean of "
        f"{cfg['steps']} steps after {cfg['warmup']}. Device: {env.get('device', r['device'])}; "
        f"torch {env.get('torch', '?')}; {env.get('date', '')}.",
        "",
        "| | ms per step |",
        "|---|---|",
        f"| step, wall clock | {r['step_wall_ms']:.2f} |",
        f"| busy: {r['busy_what']} | {r['busy_ms']:.2f} |",
    ]
    if r["not_busy_ms"] is not None:
        lines.append(f"| not busy: host work, launch gaps, synchronisations | {r['not_busy_ms']:.2f} |")
    for name, ms in (r.get("gaps_ms") or {}).items():
        lines.append(f"| idle between device operations, gaps {name} | {ms:.2f} |")
    if r.get("device_ops_per_step") is not None:
        lines.append(f"| device operations per step (kernels, copies, fills) | {r['device_ops_per_step']:.0f} |")
    lines += [f"| first step (compiles) | {1e3 * r['first_step_s']:.0f} |",
              f"| compiles during the profiled steps | {r['compiles_during_profile']} |"]
    if r["host_syncs_per_step"] is not None:
        lines.append(f"| host synchronisations per step | {r['host_syncs_per_step']} |")
    lines += ["", "| category | ms per step | share |", "|---|---|---|"]
    lines += [f"| {c} | {ms:.2f} | {100 * ms / summed:.1f}% |" for c, ms in r["categories_ms"].items()]
    lines += ["", "| top kernel / operator | ms per step | category |", "|---|---|---|"]
    lines += [f"| `{name[:90]}` | {ms:.3f} | {_category(name)} |" for name, ms in r["top"]]
    if r.get("host_sync_sites"):
        lines += ["", "| host synchronisation made at | per step |", "|---|---|"]
        lines += [f"| `{site}` | {n} |" for site, n in r["host_sync_sites"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m treecompile.bench.profile_cuda [--out FILE] [--markdown FILE] [--device cpu|cuda] ...``."""
    p = argparse.ArgumentParser(prog="python -m treecompile.bench.profile_cuda", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--markdown", default=None, help="Markdown file")
    p.add_argument("--model", default=None)
    p.add_argument("--path-tokens", type=int, default=None)
    p.add_argument("--por", type=float, default=None)
    p.add_argument("--lm-head", default=None, choices=("gather", "fused"))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    over = {"model": args.model, "path_tokens": args.path_tokens, "por": args.por, "lm_head": args.lm_head,
            "steps": args.steps}
    cfg = dataclasses.replace(ProfileConfig(), **{k: v for k, v in over.items() if v is not None})
    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile_cuda: no CUDA device", file=sys.stderr)
        return 2
    result = profile_step(cfg, device=args.device)
    if args.out:
        write_json(args.out, result)
    table = markdown_report(result)
    if args.markdown:
        write_text_atomic(args.markdown, table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
