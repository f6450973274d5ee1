"""``treecompile bench``: tree training against per-path training with sequence packing.

    treecompile bench --quick

One run compares, on the same small Qwen3-shaped model and the same paths:

* ``packed``: per-path training with sequence packing (every path its own single-path
  tree in one packed row: document-causal attention), through the same `tree_compile`
  machinery, so the difference measured is only the shared prefixes;
* ``bitmask``: the tree, ``tree_compile(mask="bitmask")`` (``pack(..., path_bits=True)``);
* ``interval``: the tree, ``tree_compile(mask="interval")``;
* ``fused``: the tree, interval mask, ``tree_compile(lm_head="fused")`` (LM head and
  log-softmax in row chunks, never the ``[rows, vocab]`` logits).

Workloads: synthetic trees at a controlled prefix overlap ratio (POR) with a constant
number of path tokens (Tree Training §4.5: ``P`` paths of ``L`` tokens sharing a prefix of
``p`` tokens, ``POR = (P - 1) p / (P L)``), and real trees from the bundled samples
(tau-bench per task, GSM8K groups). Each method's loss on each workload is checked once,
on its first step, against the packed (per-path) loss.

Reported per (workload, method): forward + backward step time (median of ``repeats``
after ``warmup`` steps, the first of which compiles), path tokens per second, speedup over
``packed``, the FLOP bound ``1 / (1 - POR)`` and the fraction of it reached, and peak
memory where measurable (CUDA only; CPU allocations are not tracked).

Kept as one module (over 450 lines): one benchmark, its configurations, workloads, timing and table.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from treecompile.core.tree import TrajectoryTree

__all__ = ["BenchConfig", "BenchRow", "BenchResult", "METHODS", "QUICK", "TINY", "run_bench", "render_table",
           "markdown_table", "noise_warnings", "synthetic_tree"]

#: Methods compared, in table order: name -> (what is packed, mask, LM head).
METHODS: dict[str, tuple[str, str, str]] = {
    "packed": ("paths", "interval", "gather"),
    "bitmask": ("tree", "bitmask", "gather"),
    "interval": ("tree", "interval", "gather"),
    "fused": ("tree", "interval", "fused"),
}

# Loss agreement with the per-path (packed) loss, relative: float32 sums over thousands of
# tokens in a different order differ at ~1e-6; a structural error is 1e-2 or worse.
LOSS_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}


@dataclass(frozen=True)
class BenchConfig:
    """What one bench run measures.

    Attributes:
        path_tokens: path tokens of each synthetic workload (``paths x path_len``).
        paths: paths per synthetic tree (a POR above ``(P - 1) / P`` cannot be reached).
        pors: target POR of each synthetic workload.
        tau_tasks: bundled tau-bench tasks, one workload each (0: none).
        gsm8k_groups: bundled GSM8K groups packed as one workload of that many trees (0: none).
        arch: ``"qwen3"`` (attention only) or ``"qwen3_next"`` (a hybrid: Gated DeltaNet and
            attention layers alternating, no experts), one of :data:`ARCHS`.
        hidden, layers, heads, kv_heads, head_dim, intermediate: the model's shape (the
            Gated DeltaNet layers use ``heads`` / ``kv_heads`` value / key heads of ``head_dim``).
        vocab: model vocabulary (at least the sample tokenizer's 2048 for real trees).
        warmup: steps before timing (the first compiles).
        repeats: timed steps; the median is reported.
        methods: names from :data:`METHODS`.
        dtype: model dtype.
        seed: for the model and the synthetic tokens.
    """

    path_tokens: int = 2048
    paths: int = 16
    pors: tuple[float, ...] = (0.0, 0.2, 0.5, 0.8, 0.92)
    tau_tasks: int = 1
    gsm8k_groups: int = 8
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 384
    vocab: int = 2048
    warmup: int = 1
    repeats: int = 5
    methods: tuple[str, ...] = tuple(METHODS)
    dtype: str = "float32"
    seed: int = 0
    arch: str = "qwen3"

    def __post_init__(self) -> None:
        # Checked here, so a bad value fails before a model is built, with the option named.
        for name in ("warmup", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.paths < 2:
            raise ValueError(f"paths (--paths) must be at least 2, got {self.paths}")
        path_len = self.path_tokens // self.paths
        if path_len < 2:
            raise ValueError(
                f"--path-tokens {self.path_tokens} over --paths {self.paths} leaves {path_len} token(s) a path; "
                "every path needs at least 2"
            )
        reachable = (self.paths - 1) * (path_len - 1) / (self.paths * path_len)
        for por in self.pors:
            if not 0.0 <= por < 1.0:
                raise ValueError(f"POR (--por) must be in [0, 1), got {por}")
            if por > reachable + 1e-9:
                raise ValueError(
                    f"POR (--por) {por} cannot be reached by {self.paths} paths of {path_len} tokens "
                    f"(at most {reachable:.3f}: every path keeps one token of its own)"
                )


#: Model families `BenchConfig.arch` accepts.
ARCHS = ("qwen3", "qwen3_next")

#: ``treecompile bench --quick``: a few minutes on 2 CPU cores.
QUICK = BenchConfig()
#: Seconds: for tests. 512 path tokens: every workload, the GSM8K one included, has more rows than
#: one attention block (128), so each method compiles once for all of them (at 64 path tokens the
#: GSM8K workload recompiled every method: 42 s of CPU against 34.5 s, 2 cores).
TINY = BenchConfig(path_tokens=512, paths=4, pors=(0.0, 0.5), tau_tasks=0, gsm8k_groups=1, hidden=32, layers=1,
                   heads=2, kv_heads=1, head_dim=16, intermediate=64, warmup=1, repeats=1)


@dataclass
class BenchRow:
    """One (workload, method) measurement."""

    workload: str
    method: str
    por: float
    path_tokens: int
    rows: int
    step_ms: float
    tokens_per_s: float
    loss: float
    loss_rel_diff: float
    exact: bool
    first_step_s: float
    peak_mem_mib: float | None = None
    speedup: float = 1.0
    bound: float = 1.0
    step_ms_min: float = 0.0
    step_ms_max: float = 0.0
    speedup_low: float = 1.0
    speedup_high: float = 1.0

    @property
    def bound_fraction(self) -> float:
        return self.speedup / self.bound

    @property
    def spread(self) -> float:
        """``(max - min) / median`` of the timed steps: how far one repeat can be off."""
        return (self.step_ms_max - self.step_ms_min) / self.step_ms

    @property
    def within_noise(self) -> bool:
        """The speedup over packed is smaller than the spread of the repeats: the range of
        ratios the repeats allow (fastest over slowest and back) includes 1."""
        return self.method != "packed" and self.speedup_low <= 1.0 <= self.speedup_high


@dataclass
class BenchResult:
    """Rows plus where and how they were measured."""

    rows: list[BenchRow]
    config: BenchConfig
    env: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "config": asdict(self.config),
            "rows": [{**asdict(r), "bound_fraction": r.bound_fraction, "spread": r.spread,
                      "within_noise": r.within_noise} for r in self.rows],
            "warnings": noise_warnings(self),
        }


# ---------------------------------------------------------------------------- workloads


def synthetic_tree(paths: int, path_len: int, por: float, vocab: int, seed: int = 0) -> TrajectoryTree:
    """``paths`` paths of ``path_len`` tokens sharing one prefix sized to reach ``por``.

    ``POR = (P - 1) p / (P L)`` for a shared prefix of ``p`` tokens, so
    ``p = round(por P L / (P - 1))``, at most ``L - 1`` (every path keeps one own token).
    The suffixes start with distinct tokens, so the tree branches exactly at ``p``.
    """
    if paths < 2 or path_len < 2:
        raise ValueError(f"need at least 2 paths of 2 tokens, got {paths} x {path_len}")
    if vocab < paths + 1:
        raise ValueError(f"vocab {vocab} too small for {paths} distinct branches")
    prefix = min(path_len - 1, round(por * paths * path_len / (paths - 1)))
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, prefix).tolist()
    firsts = rng.permutation(vocab)[:paths].tolist()
    seqs = [shared + [firsts[i]] + rng.integers(0, vocab, path_len - prefix - 1).tolist() for i in range(paths)]
    return TrajectoryTree.from_sequences(seqs)


def _workloads(cfg: BenchConfig) -> list[tuple[str, list[TrajectoryTree]]]:
    out: list[tuple[str, list[TrajectoryTree]]] = []
    path_len = cfg.path_tokens // cfg.paths
    for i, por in enumerate(cfg.pors):
        out.append((f"synthetic POR {por:g}", [synthetic_tree(cfg.paths, path_len, por, cfg.vocab, cfg.seed + i)]))
    if cfg.tau_tasks or cfg.gsm8k_groups:
        from treecompile.data import samples as data
        from treecompile.chat.to_tree import tree_from_messages
        from treecompile.chat.tokenizer import load_tokenizer

        tok = load_tokenizer("sample")
        if tok.vocab_size > cfg.vocab:
            raise ValueError(f"vocab {cfg.vocab} is smaller than the sample tokenizer's {tok.vocab_size}")

        def tree(convs):
            return tree_from_messages(convs, tok, on_drift="ignore")

        for task, convs in list(data.sample_tau_bench().items())[: cfg.tau_tasks]:
            out.append((f"tau-bench task {task}", [tree(convs)]))
        if cfg.gsm8k_groups:
            groups = list(data.sample_gsm8k().values())[: cfg.gsm8k_groups]
            out.append((f"gsm8k {len(groups)} groups", [tree(g) for g in groups]))
    return out


def _per_path_trees(trees: list[TrajectoryTree]) -> list[TrajectoryTree]:
    return [
        TrajectoryTree.from_sequences([p.tokens], weights=[p.weight], loss_masks=[p.loss_mask])
        for t in trees
        for p in t.paths()
    ]


# ---------------------------------------------------------------------------- measuring


def _model(cfg: BenchConfig) -> torch.nn.Module:
    import transformers
    from transformers import AutoModelForCausalLM

    if cfg.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {cfg.arch!r}")
    torch.manual_seed(cfg.seed)
    shape = dict(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=1 << 17,
    )
    if cfg.arch == "qwen3":
        config = transformers.Qwen3Config(**shape)
    else:
        config = transformers.Qwen3NextConfig(
            **shape, layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(cfg.layers)],
            linear_num_key_heads=cfg.kv_heads, linear_num_value_heads=cfg.heads, linear_key_head_dim=cfg.head_dim,
            linear_value_head_dim=cfg.head_dim, linear_conv_kernel_dim=4, num_experts=0,
        )
    return AutoModelForCausalLM.from_config(config).to(getattr(torch, cfg.dtype)).train()


def environment(command: str | None = None) -> dict[str, str]:
    """Device, versions, command and date, as the bench prints them."""
    import importlib.metadata as md

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return {
        "device": device,
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "treecompile": version("treecompile"),
        "python": platform.python_version(),
        "command": command if command is not None else " ".join(["treecompile", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _step(compiled, batch) -> torch.Tensor:
    compiled.zero_grad()
    out = compiled(batch)
    out.loss.backward()
    return out.loss.detach()


def _time(compiled, batch, cfg: BenchConfig, device: torch.device) -> tuple[float, float, list[float], float | None]:
    """``(loss, first step s, every timed step s, peak MiB)``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    loss = float(_step(compiled, batch))
    sync()
    first = time.perf_counter() - t0
    for _ in range(cfg.warmup - 1):
        _step(compiled, batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(cfg.repeats):
        sync()
        t0 = time.perf_counter()
        _step(compiled, batch)
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return loss, first, times, peak


def run_bench(cfg: BenchConfig = QUICK, *, device: str | None = None, command: str | None = None,
              progress: Any = None, on_row: Any = None) -> BenchResult:
    """Runs every method on every workload; see the module docstring.

    Args:
        cfg: what to measure.
        device: ``"cpu"`` or ``"cuda"``; None picks CUDA when present.
        command: the command line to record (defaults to this process's).
        progress: called with a line of text before each measurement, or None.
        on_row: called with the rows so far (a `BenchResult`) after each measurement, or None.
    """
    from treecompile.core.batch import pack
    from treecompile.compile.wrapper import tree_compile

    from treecompile.core.errors import unknown_choice

    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown:
        raise ValueError(unknown_choice("methods", unknown, METHODS, "methods"))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = _model(cfg).to(dev)
    dtype = next(model.parameters()).dtype
    compiled = {m: tree_compile(model, mask=METHODS[m][1], lm_head=METHODS[m][2]) for m in cfg.methods}
    rows: list[BenchRow] = []
    env = environment(command)
    for name, trees in _workloads(cfg):
        stats = [t.stats() for t in trees]
        path_tokens = sum(s.path_tokens for s in stats)
        por = 1.0 - sum(s.tree_tokens for s in stats) / path_tokens
        ref_loss = None
        for method in ("packed", *[m for m in cfg.methods if m != "packed"]):
            layout, mask, _ = METHODS[method]
            batch = pack(
                _per_path_trees(trees) if layout == "paths" else trees, path_bits=mask == "bitmask", device=dev,
                warn_por=False,  # the workloads' PORs are chosen
            )
            if method not in cfg.methods:  # the reference loss even when packed is not timed
                ref_loss = float(_step(tree_compile(model), batch))
                continue
            if progress is not None:
                progress(f"{name}: {method} ({batch.num_tokens} rows)")
            loss, first, times, peak = _time(compiled[method], batch, cfg, dev)
            step = statistics.median(times)
            if method == "packed":
                ref_loss = loss
            diff = abs(loss - ref_loss) / max(1.0, abs(ref_loss))
            rows.append(BenchRow(
                workload=name, method=method, por=por, path_tokens=path_tokens, rows=batch.num_tokens,
                step_ms=step * 1e3, tokens_per_s=path_tokens / step, loss=loss, loss_rel_diff=diff,
                exact=diff <= LOSS_RTOL.get(dtype, 1e-4), first_step_s=first, peak_mem_mib=peak,
                bound=1.0 / (1.0 - por), step_ms_min=min(times) * 1e3, step_ms_max=max(times) * 1e3,
            ))
            base = {r.method: r for r in rows if r.workload == name}.get("packed")  # measured first
            if base is not None:
                r = rows[-1]
                r.speedup = base.step_ms / r.step_ms
                r.speedup_low = base.step_ms_min / r.step_ms_max
                r.speedup_high = base.step_ms_max / r.step_ms_min
            if on_row is not None:
                on_row(BenchResult(list(rows), cfg, env))
    return BenchResult(rows, cfg, env)


# ---------------------------------------------------------------------------- output

_COLUMNS = ("workload", "POR", "path tok", "rows", "method", "step ms", "spread", "path tok/s", "speedup", "bound",
            "of bound", "loss Δrel", "peak MiB")


def _cells(r: BenchRow) -> list[str]:
    return [
        r.workload, f"{r.por:.3f}", str(r.path_tokens), str(r.rows), r.method, f"{r.step_ms:.1f}",
        f"{r.spread:.0%}", f"{r.tokens_per_s:,.0f}", f"{r.speedup:.2f}x" + (" ~" if r.within_noise else ""),
        f"{r.bound:.2f}x", f"{r.bound_fraction:.0%}",
        f"{r.loss_rel_diff:.1e}" + ("" if r.exact else " MISMATCH"),
        "n/a" if r.peak_mem_mib is None else f"{r.peak_mem_mib:.0f}",
    ]


_ARCH_NAMES = {"qwen3": "Qwen3", "qwen3_next": "Qwen3-Next (Gated DeltaNet + attention)"}


def _header(result: BenchResult) -> list[str]:
    e = result.env
    return [
        f"device: {e['device']}; torch {e['torch']}, transformers {e['transformers']}, "
        f"treecompile {e['treecompile']}, python {e['python']}",
        f"command: {e['command']}",
        f"date: {e['date']}",
        f"model: {_ARCH_NAMES[result.config.arch]}-shaped, {result.config.layers} layers, hidden {result.config.hidden}, vocab "
        f"{result.config.vocab}, {result.config.dtype}; step = forward + backward, median of "
        f"{result.config.repeats} after {result.config.warmup} warm-up (compile); spread = (max - min) / median "
        "of the repeats; ~ marks a speedup the spread could explain",
    ]


def noise_warnings(result: BenchResult) -> list[str]:
    """One line per speedup that the spread of the repeats could explain (marked ``~`` in the tables).

    The spread of a method is ``(max - min) / median`` of its timed steps; a speedup is within
    the noise when the ratio of the fastest packed step to the slowest step of the method, and
    of the slowest packed step to the fastest, lie on both sides of 1.
    """
    if result.config.repeats < 2:
        return ["one timed step per measurement: no spread measured, the speedups may be noise (--repeats 5 or more)"]
    out = []
    packed = {r.workload: r for r in result.rows if r.method == "packed"}
    for r in result.rows:
        if r.within_noise:
            base = packed[r.workload]
            out.append(
                f"{r.workload} / {r.method}: speedup {r.speedup:.2f}x is within the spread of the "
                f"{result.config.repeats} repeats (packed {base.step_ms_min:.1f}-{base.step_ms_max:.1f} ms, "
                f"{r.method} {r.step_ms_min:.1f}-{r.step_ms_max:.1f} ms: "
                f"{r.speedup_low:.2f}x to {r.speedup_high:.2f}x); "
                "measure on an idle machine or with more --repeats"
            )
    return out


def render_table(result: BenchResult) -> Any:
    """A ``rich`` renderable: the header lines and the comparison table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="tree training vs per-path packing", show_lines=False)
    for c in _COLUMNS:
        table.add_column(c, justify="left" if c in ("workload", "method") else "right")
    last = None
    for r in result.rows:
        if last is not None and r.workload != last:
            table.add_section()
        table.add_row(*_cells(r), style=None if r.exact else "bold red")
        last = r.workload
    return Group(*[Text(line) for line in _header(result)], table)


def markdown_table(result: BenchResult) -> str:
    """The same table as Markdown, with the header lines above it (for docs/benchmarks.md)."""
    lines = [f"- {line}" for line in _header(result)] + ["", "| " + " | ".join(_COLUMNS) + " |",
                                                          "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result.rows]
    return "\n".join(lines)


def with_overrides(cfg: BenchConfig, **kw: Any) -> BenchConfig:
    """``cfg`` with the fields in ``kw`` that are not None replaced."""
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})
