"""``treecompile bench --device cuda``: tree training against what a user runs today, at real shapes.

    treecompile bench --device cuda                         # Qwen3-0.6B and -1.7B shapes, bf16
    python -m treecompile.bench_cuda --out bench.json       # the same, JSON written after every row

Models: Qwen3-0.6B and Qwen3-1.7B configurations with random weights in bfloat16. Workloads:
synthetic trees of 16 paths at 16k and 32k path tokens and POR 0 / 0.5 / 0.8 / 0.92 (as in
`treecompile.bench`), and the bundled real trees (a tau-bench task, GSM8K groups).

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

Kept as one module (over 450 lines): one benchmark, its workloads, the baselines written out as
a user runs them, the run and its table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["MODEL_SHAPES", "METHODS", "CudaBenchConfig", "DEFAULT", "CudaRow", "run_cuda_bench", "markdown_table",
           "cmd_bench_cuda", "main"]

#: Hugging Face Qwen3 shapes (the published configs' sizes; weights random).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # Seconds on a CPU: for tests of this module.
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=2048, tie_word_embeddings=True),
}

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
        real_data: add the bundled tau-bench task and GSM8K groups as workloads.
        methods: names from :data:`METHODS`.
        dtype: model dtype.
        warmup, repeats: steps before timing (the first compiles), and timed steps.
        compile_baselines: run the HF baselines under ``torch.compile``.
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
    methods: tuple[str, ...] = METHODS
    dtype: str = "bfloat16"
    warmup: int = 2
    repeats: int = 5
    compile_baselines: bool = True
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
    loss: float | None = None
    loss_rel_diff: float | None = None
    micro_batches: int = 1
    speedup_vs_packed: float | None = None
    speedup_vs_padded: float | None = None

    @property
    def bound(self) -> float:
        return 1.0 / (1.0 - self.por) if self.por < 1 else float("inf")

    @property
    def bound_fraction(self) -> float | None:
        """Speed-up over the faster baseline that ran, as a fraction of the FLOP bound."""
        ups = [u for u in (self.speedup_vs_packed, self.speedup_vs_padded) if u is not None]
        return min(ups) / self.bound if ups else None


# ---------------------------------------------------------------------------- workloads


def _workloads(cfg: CudaBenchConfig, vocab: int) -> list[tuple[str, list]]:
    from treecompile import bench

    out = []
    for tokens in cfg.path_tokens:
        for i, por in enumerate(cfg.pors):
            tree = bench.synthetic_tree(cfg.paths, tokens // cfg.paths, por, vocab, cfg.seed + i)
            size = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
            out.append((f"{size} POR {por:g}", [tree]))
    if cfg.real_data:
        real = bench.BenchConfig(pors=(), tau_tasks=1, gsm8k_groups=8, vocab=vocab)
        out += bench._workloads(real)
    return out


def _paths(trees) -> list[tuple[list[int], list[bool]]]:
    """Each path's tokens and loss mask (position 0 never a target)."""
    out = []
    for t in trees:
        for p in t.paths():
            if p.weight != 1:
                raise ValueError("the HF baselines' loss has no per-path weights; paths of weight 1 only")
            mask = [True] * len(p.tokens) if p.loss_mask is None else [bool(m) for m in p.loss_mask]
            out.append((list(p.tokens), mask))
    return out


# ---------------------------------------------------------------------------- methods


def _model(name: str, dtype: torch.dtype, device: torch.device, seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**MODEL_SHAPES[name], max_position_embeddings=1 << 17)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def _padded_inputs(paths, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(t) for t, _ in paths)
    ids = torch.zeros(len(paths), width, dtype=torch.int64)
    att = torch.zeros(len(paths), width, dtype=torch.int64)
    labels = torch.full((len(paths), width), -100, dtype=torch.int64)
    for i, (toks, mask) in enumerate(paths):
        n = len(toks)
        ids[i, :n] = torch.tensor(toks)
        att[i, :n] = 1
        lab = torch.tensor(toks)
        lab[~torch.tensor(mask)] = -100
        labels[i, :n] = lab
    return ids.to(device), att.to(device), labels.to(device)


def _packed_inputs(paths, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, pos, labels = [], [], []
    for toks, mask in paths:
        ids += toks
        pos += list(range(len(toks)))
        lab = [t if m else -100 for t, m in zip(toks, mask)]
        lab[0] = -100  # HF shifts labels: the first token would be "predicted" by the previous path
        labels += lab
    as_row = lambda x: torch.tensor([x], dtype=torch.int64, device=device)  # noqa: E731
    return as_row(ids), as_row(pos), as_row(labels)


def _micro_batches(paths, micro: int) -> list[list]:
    """The paths in ``micro`` consecutive groups of (nearly) equal size."""
    k = -(-len(paths) // micro)
    return [paths[i:i + k] for i in range(0, len(paths), k)]


def _targets(paths) -> int:
    """Targets HF's shifted labels count: every loss-masked token after a path's first."""
    return sum(sum(m[1:]) for _, m in paths)


class _Baseline:
    """One step of an HF baseline over ``micro`` micro-batches of the paths (1 unless a step ran
    out of memory): HF's loss is a token mean per call, so each micro-batch's is re-weighted to
    the mean over all (gradient accumulation). The inputs are built once per ``micro``, outside
    the timed steps, as the tree's batch is packed once."""

    attention: str  #: the HF attention implementation the model runs with

    def __init__(self, model, fn, paths, device):
        self.model, self.fn, self.paths, self.device = model, fn, paths, device
        self.micro = 1
        self.total = _targets(paths)
        self._inputs: tuple[int, list] | None = None  # (micro, [(call kwargs, targets)])

    def _call_kwargs(self, paths) -> dict:
        raise NotImplementedError

    def __call__(self) -> float:
        if self._inputs is None or self._inputs[0] != self.micro:
            self._inputs = None  # the previous micro-batches' memory first
            self._inputs = (self.micro, [(self._call_kwargs(part), _targets(part))
                                         for part in _micro_batches(self.paths, self.micro)])
        self.model.config._attn_implementation = self.attention
        loss_sum = 0.0
        for kwargs, n in self._inputs[1]:
            out = self.fn(**kwargs, use_cache=False)
            (out.loss * (n / self.total)).backward()
            loss_sum += float(out.loss.detach()) * n / self.total
        return loss_sum


class _Padded(_Baseline):
    """The paths right-padded into one batch with an attention mask, SDPA."""

    attention = "sdpa"

    def _call_kwargs(self, paths) -> dict:
        ids, att, labels = _padded_inputs(paths, self.device)
        return dict(input_ids=ids, attention_mask=att, labels=labels)


class _Packed(_Baseline):
    """The paths packed into one row. With FlexAttention, the document-causal BlockMask is
    handed to HF (which passes a BlockMask through unchanged): the interval rule on a forest of
    one-path trees, built from per-block bounds like the tree's own. Otherwise HF derives the
    document mask from ``position_ids``."""

    def __init__(self, model, fn, paths, device, attention: str):
        super().__init__(model, fn, paths, device)
        self.attention = attention

    def _call_kwargs(self, paths) -> dict:
        ids, pos, labels = _packed_inputs(paths, self.device)
        mask = None
        if self.attention == "flex_attention":
            from treecompile.kernels.blockmask import tree_block_mask

            ends, total = [], 0
            for t, _ in paths:
                total += len(t)
                ends += [total] * len(t)
            mask = tree_block_mask(torch.tensor(ends, dtype=torch.int64, device=self.device))
        return dict(input_ids=ids, position_ids=pos, attention_mask=mask, labels=labels)


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
    from treecompile.batch import pack
    from treecompile.bench import environment
    from treecompile.compile import tree_compile

    bad = [m for m in cfg.models if m not in MODEL_SHAPES] + [m for m in cfg.methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown models or methods {bad}; models: {', '.join(MODEL_SHAPES)}; "
                         f"methods: {', '.join(METHODS)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: treecompile bench --device cuda needs one")
    dtype = getattr(torch, cfg.dtype)
    result: dict[str, Any] = {"env": environment(command), "config": asdict(cfg), "rows": []}
    rows: list[CudaRow] = []
    start = time.perf_counter()
    for model_name in cfg.models:
        model, fns = None, {}
        for workload, trees in _workloads(cfg, MODEL_SHAPES[model_name]["vocab_size"]):
            if model is None and time.perf_counter() - start <= cfg.time_budget_s:
                model = _model(model_name, dtype, dev, cfg.seed)
                # One compiled function per method and model, reused by every workload (dynamic shapes).
                fns = {m: _compiled_for(m, model, cfg, tree_compile) for m in cfg.methods}
            stats = [t.stats() for t in trees]
            path_tokens = sum(s.path_tokens for s in stats)
            por = 1.0 - sum(s.tree_tokens for s in stats) / path_tokens
            paths = _paths(trees)
            batch_rows = {"tree": sum(s.tree_tokens for s in stats), "tree-fused": sum(s.tree_tokens for s in stats),
                          "hf-padded-sdpa": len(paths) * max(len(t) for t, _ in paths),
                          "hf-packed-flex": path_tokens}
            group: list[CudaRow] = []
            for method in cfg.methods:
                row = CudaRow(model_name, workload, method, por, path_tokens, batch_rows[method])
                group.append(row)
                if time.perf_counter() - start > cfg.time_budget_s:
                    row.status = f"not run: time budget {cfg.time_budget_s:.0f} s spent"
                    continue
                if progress is not None:
                    progress(f"{model_name} / {workload}: {method}")
                _run_row(row, method, model, fns[method], trees, paths, cfg, dev, pack)
            _relate(group, cfg)
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


def _compiled_for(method: str, model, cfg: CudaBenchConfig, tree_compile):
    if method.startswith("tree"):
        return tree_compile(model, lm_head="fused" if method == "tree-fused" else "gather")
    return torch.compile(model) if cfg.compile_baselines else model


def _run_row(row: CudaRow, method: str, model, fn, trees, paths, cfg, dev, pack) -> None:
    try:
        if method in ("hf-padded-sdpa", "hf-packed-flex"):
            step = (_Padded(model, fn, paths, dev) if method == "hf-padded-sdpa"
                    else _Packed(model, fn, paths, dev, cfg.packed_attention))
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
        else:
            measured = _measure(_Tree(fn, pack(trees, device=dev, warn_por=False)), model, cfg, dev)
    except Exception as e:  # one failing row never stops the others
        model.zero_grad(set_to_none=True)
        row.status = ("out of memory" if _is_oom(e) else "error") + f": {type(e).__name__}: {str(e)[:300]}"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return
    loss, first, step_s, peak = measured
    row.loss, row.first_step_s, row.step_ms, row.peak_gib = loss, first, step_s * 1e3, peak
    row.tokens_per_s = row.path_tokens / step_s


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
    return {**asdict(r), "bound": r.bound, "bound_fraction": r.bound_fraction}


# ---------------------------------------------------------------------------- output

_COLUMNS = ("model", "workload", "POR", "path tok", "rows", "method", "step ms", "path tok/s", "peak GiB",
            "vs packed", "vs padded", "bound", "of bound", "loss Δrel", "status")


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
        lines.append("| " + " | ".join([
            r["model"], r["workload"], f"{r['por']:.3f}", str(r["path_tokens"]), str(r["rows"]), r["method"],
            _fmt(r["step_ms"], ".1f"), _fmt(r["tokens_per_s"], ",.0f"), _fmt(r["peak_gib"], ".2f"),
            _fmt(r["speedup_vs_packed"], ".2f", "x"), _fmt(r["speedup_vs_padded"], ".2f", "x"),
            f"{r['bound']:.2f}x", _fmt(r["bound_fraction"], ".0%"), _fmt(diff, ".1e") + flag, status,
        ]) + " |")
    return "\n".join(lines)


def mismatches(result: dict) -> list[str]:
    """Rows whose loss differs from the packed baseline's beyond the dtype's tolerance."""
    tol = LOSS_RTOL.get(result["config"]["dtype"], 1e-4)
    return [f"{r['model']}/{r['workload']}/{r['method']}" for r in result["rows"]
            if r["loss_rel_diff"] is not None and r["loss_rel_diff"] > tol]


def cmd_bench_cuda(args: argparse.Namespace) -> int:
    """``treecompile bench --device cuda``: the common bench options that apply here override
    :data:`DEFAULT` (``--path-tokens``, ``--paths``, ``--por``, ``--repeats``, ``--methods``)."""
    ignored = [flag for flag, on in (("--arch", getattr(args, "arch", None) not in (None, "qwen3")),
                                      ("--tiny", getattr(args, "tiny", False))) if on]
    if ignored:
        print(f"treecompile bench: error: {', '.join(ignored)} do not apply with --device cuda (Qwen3 shapes; "
              "python -m treecompile.bench_cuda --help for its options)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("treecompile bench: error: --device cuda: no CUDA device", file=sys.stderr)
        return 2
    over = {"path_tokens": (args.path_tokens,) if getattr(args, "path_tokens", None) else None,
            "paths": getattr(args, "paths", None), "repeats": getattr(args, "repeats", None),
            "pors": tuple(args.por) if getattr(args, "por", None) else None,
            "methods": tuple(args.methods) if getattr(args, "methods", None) else None}
    cfg = dataclasses.replace(DEFAULT, **{k: v for k, v in over.items() if v is not None})
    result = run_cuda_bench(cfg, progress=lambda s: print(s, file=sys.stderr))
    print(json.dumps(result, indent=2) if getattr(args, "json", False) else markdown_table(result))
    bad = mismatches(result)
    if bad:
        print(f"treecompile bench: loss differs from the packed baseline: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m treecompile.bench_cuda [--out FILE] [--quick] [--device cpu|cuda]``."""
    p = argparse.ArgumentParser(prog="python -m treecompile.bench_cuda", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON file, rewritten after every row (partial results survive)")
    p.add_argument("--markdown", default=None, help="Markdown table file, written at the end")
    p.add_argument("--models", nargs="+", default=None, choices=list(MODEL_SHAPES))
    p.add_argument("--path-tokens", type=int, nargs="+", default=None)
    p.add_argument("--por", type=float, nargs="+", default=None)
    p.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                   help="a subset of the methods (default: all)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--no-real-data", action="store_true")
    p.add_argument("--time-budget", type=float, default=None, metavar="S")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    over = {"models": tuple(args.models) if args.models else None,
            "path_tokens": tuple(args.path_tokens) if args.path_tokens else None,
            "pors": tuple(args.por) if args.por else None, "repeats": args.repeats,
            "methods": tuple(args.methods) if args.methods else None,
            "real_data": False if args.no_real_data else None, "time_budget_s": args.time_budget,
            "dtype": args.dtype}
    cfg = dataclasses.replace(DEFAULT, **{k: v for k, v in over.items() if v is not None})
    if args.device == "cpu":  # FlexAttention has no CPU backward, and compiling baselines on CPU is slow
        cfg = dataclasses.replace(cfg, packed_attention="sdpa", compile_baselines=False)
    elif not torch.cuda.is_available():
        print("bench_cuda: no CUDA device", file=sys.stderr)
        return 2

    def write(result):
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)

    command = " ".join(["python -m treecompile.bench_cuda", *(sys.argv[1:] if argv is None else argv)])
    result = run_cuda_bench(cfg, device=args.device, progress=lambda s: print(s, file=sys.stderr, flush=True),
                            on_row=write, command=command)
    write(result)
    table = markdown_table(result)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    print(table)
    return 1 if mismatches(result) else 0


if __name__ == "__main__":
    raise SystemExit(main())
