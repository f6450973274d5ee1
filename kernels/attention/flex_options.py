"""FlexAttention kernel options (tile sizes, warps, stages) per GPU, head dim and dtype.

    opts = flex_kernel_options(q)          # {} on CPU or for a shape the table lacks
    treecompile tune                       # measures candidates on this GPU, prints a new table

:func:`treecompile.kernels.attention.flex.call_flex_hop` passes these to FlexAttention on CUDA; the
table below is the one place they are written, and it holds only entries measured to beat
torch's own choice on a tree step. **It is empty**: on an H100 (torch 2.11, triton 3.6,
2026-11-27, `scripts/gpu.sh perf`) no candidate for head dim 128 in bfloat16 beat torch's
default beyond the spread of the timings: forward + backward of one 16k-row tree attention,
torch's default 8.08 ms, the fastest candidate 7.93 ms (-1.8%, one timing of each), and a
Qwen3-1.7B-shaped step (8 layers, POR 0.8) 73.7 ms with torch 2.13's restated defaults and
73.2 ms with that candidate. Other head dims, dtypes and GPUs were not measured. A table
measured elsewhere (`treecompile tune --write FILE`) is used without editing this file by
setting ``TREECOMPILE_FLEX_OPTIONS=FILE``.

Tree masks give a constraint torch's defaults need not meet: treecompile's BlockMasks use
128-row blocks (:data:`treecompile.kernels.attention.flex.BLOCK_SIZE`), and FlexAttention needs the
mask's block size to be a multiple of every kernel tile, so every tile here divides 128.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["FlexOptions", "FLEX_OPTIONS", "TABLE_ENV", "arch_of", "candidates", "flex_kernel_options", "load_table",
           "save_table", "tune", "format_table"]

#: A JSON file written by ``treecompile tune --write FILE``: when set, its table replaces
#: :data:`FLEX_OPTIONS` (a key it lacks gets torch's own choice), e.g. for a GPU the package's
#: table has not measured.
TABLE_ENV = "TREECOMPILE_FLEX_OPTIONS"

#: Rows per BlockMask block; each tile must divide it (kept equal to ``kernels.attention.flex.BLOCK_SIZE``).
MASK_BLOCK = 128


@dataclass(frozen=True)
class FlexOptions:
    """One FlexAttention configuration.

    Attributes:
        fwd: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the forward kernel.
        bwd: ``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)`` of the backward.
    """

    fwd: tuple[int, int, int, int]
    bwd: tuple[int, int, int, int, int, int]

    def __post_init__(self) -> None:
        tiles = (*self.fwd[:2], *self.bwd[:4])
        if any(t < 16 or MASK_BLOCK % t for t in tiles):
            raise ValueError(f"every tile must divide the {MASK_BLOCK}-row mask block: {self}")
        m1, n1, m2, n2 = self.bwd[:4]
        if n1 % m1 or m2 % n2:
            raise ValueError(f"backward tiles need BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0: {self}")

    def as_kernel_options(self) -> dict[str, int]:
        """FlexAttention ``kernel_options`` (``fwd_`` / ``bwd_`` prefixed keys)."""
        bm, bn, fw, fs = self.fwd
        m1, n1, m2, n2, bw, bs = self.bwd
        return {
            "fwd_BLOCK_M": bm, "fwd_BLOCK_N": bn, "fwd_num_warps": fw, "fwd_num_stages": fs,
            "bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_warps": bw, "bwd_num_stages": bs,
        }


#: (GPU arch, head dim, dtype) -> options: entries measured to beat torch's default (none yet;
#: see the module docstring); a key without an entry gets torch's own choice.
FLEX_OPTIONS: dict[tuple[str, int, str], FlexOptions] = {}


def arch_of(device: torch.device) -> str:
    """``"sm90"`` for a Hopper GPU (compute capability 9.0), and so on."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_table(table: dict[tuple[str, int, str], FlexOptions], path: str, note: str = "") -> None:
    """Writes ``table`` as JSON for :data:`TABLE_ENV` / `load_table`."""
    rows = [{"arch": a, "head_dim": d, "dtype": t, "fwd": list(o.fwd), "bwd": list(o.bwd)}
            for (a, d, t), o in sorted(table.items())]
    with open(path, "w") as f:
        json.dump({"note": note, "entries": rows}, f, indent=2)


@functools.cache
def load_table(path: str) -> dict[tuple[str, int, str], FlexOptions]:
    """A table written by `save_table`.

    Raises:
        ValueError: the file is not such a table (the message names the file).
    """
    try:
        with open(path) as f:
            rows = json.load(f)["entries"]
        return {(r["arch"], int(r["head_dim"]), r["dtype"]): FlexOptions(tuple(r["fwd"]), tuple(r["bwd"]))
                for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{TABLE_ENV}={path}: not a FlexAttention options table written by "
                         f"`treecompile tune --write` ({type(e).__name__}: {e})") from e


def flex_kernel_options(q: torch.Tensor, table: dict | None = None) -> dict[str, int]:
    """The table's kernel options for queries ``q`` ``[B, H, S, D]``; ``{}`` (torch's own
    choice) off CUDA or for a (GPU, head dim, dtype) the table lacks. The table is ``table``,
    else the file :data:`TABLE_ENV` names, else :data:`FLEX_OPTIONS`."""
    if q.device.type != "cuda":
        return {}
    if table is None:
        path = os.environ.get(TABLE_ENV)
        table = load_table(path) if path else FLEX_OPTIONS
    entry = table.get((arch_of(q.device), q.shape[-1], _dtype_name(q.dtype)))
    return entry.as_kernel_options() if entry is not None else {}


def candidates(head_dim: int, dtype: torch.dtype) -> list[FlexOptions]:
    """Configurations `tune` times: a small grid around torch's defaults (tiles dividing 128).
    The backward's variants come first: on a tree step its kernel takes about 3.6 times the
    forward's (H100, 2026-11-24), and a time budget may stop the list early."""
    small = dtype == torch.float32 or head_dim > 128
    fwd_tiles = [(64, 64), (128, 32), (32, 64)] if small else [(128, 128), (128, 64), (64, 64), (64, 128)]
    bwd_tiles = [(16, 16, 16, 16), (32, 32, 32, 32)] if small else [(64, 128, 128, 64), (32, 64, 64, 32),
                                                                   (64, 64, 64, 64)]
    base_fwd = (64, 64, 4, 3) if small else (128, 64, 8, 3)  # torch's sm90 forward default, bf16 / fp16
    bwd: list[FlexOptions] = [FlexOptions(fwd=base_fwd, bwd=(*tiles, warps, 2 if small else 3))
                              for tiles in bwd_tiles[1:] for warps in (4, 8)]
    fwd = [FlexOptions(fwd=(bm, bn, warps, 3), bwd=(*bwd_tiles[0], 4 if small else 8, 1 if small else 3))
           for bm, bn in fwd_tiles for warps in (4, 8)]
    return bwd + fwd


def _synthetic_subtree_end(rows: int, paths: int, device) -> torch.Tensor:
    """``subtree_end`` of a tree with one shared prefix of half the rows and ``paths`` leaves.

    In DFS order the prefix's rows come first and its subtree ends at the last row; leaf
    ``i``'s rows end where leaf ``i + 1`` starts.
    """
    prefix = rows // 2
    leaf = (rows - prefix) // paths
    total = prefix + paths * leaf
    ends = [total] * prefix + [prefix + (i + 1) * leaf for i in range(paths) for _ in range(leaf)]
    return torch.tensor(ends, dtype=torch.int64, device=device)


def _time_config(opts: dict, q, k, v, block_mask, repeats: int) -> float:
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()  # one compile per configuration, never Dynamo's recompile limit (eager beyond it)
    fn = torch.compile(flex_attention, dynamic=False)

    def step():
        out = fn(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=opts or None)
        out.sum().backward()

    step()  # compiles
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def tune(
    head_dims: Sequence[int] = (64, 128),
    dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    *,
    rows: int = 16384,
    heads: int = 16,
    kv_heads: int = 8,
    repeats: int = 10,
    time_budget_s: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[tuple[str, int, str], FlexOptions], list[dict]]:
    """Times every candidate (forward + backward of one tree attention, median of ``repeats``
    CUDA-event timings after a compiling call) and returns ``(best per key, all timings)``.

    The tree has one shared prefix of half the ``rows`` and 8 leaves, masked with the
    interval rule through treecompile's own BlockMask builder. Past ``time_budget_s`` no
    further candidate starts (torch's default is always timed first); the timings say which ran.

    Raises:
        RuntimeError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: FlexAttention kernel options are tuned on the GPU they run on")
    from treecompile.kernels.attention.blockmask import tree_block_mask

    dev = torch.device("cuda")
    arch = arch_of(dev)
    # The interval rule's BlockMask, its mask_mod reading subtree_end (as a closure here).
    block_mask = tree_block_mask(_synthetic_subtree_end(rows, 8, dev), block_size=MASK_BLOCK)
    best: dict[tuple[str, int, str], FlexOptions] = {}
    timings: list[dict] = []
    t0 = time.perf_counter()
    for dtype in dtypes:
        for d in head_dims:
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(1, heads, rows, d, device=dev, dtype=dtype, generator=g, requires_grad=True)
            k = torch.randn(1, kv_heads, rows, d, device=dev, dtype=dtype, generator=g, requires_grad=True)
            v = torch.randn(1, kv_heads, rows, d, device=dev, dtype=dtype, generator=g, requires_grad=True)
            key = (arch, d, _dtype_name(dtype))
            scored: list[tuple[float, FlexOptions | None]] = []
            for opts in [None, *candidates(d, dtype)]:
                label = "torch default" if opts is None else str(opts)
                if opts is not None and time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                    timings.append({"key": list(key), "options": label, "ms": None,
                                    "error": f"not run: time budget {time_budget_s:.0f} s spent"})
                    continue
                try:
                    ms = _time_config({} if opts is None else opts.as_kernel_options(), q, k, v, block_mask, repeats)
                except Exception as e:  # a configuration the compiler rejects (e.g. out of shared memory)
                    timings.append({"key": list(key), "options": label, "ms": None, "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                timings.append({"key": list(key), "options": label, "ms": ms})
                if progress is not None:
                    progress(f"{key}: {label}: {ms:.3f} ms")
                scored.append((ms, opts))
            if scored:
                ms, opts = min(scored, key=lambda s: s[0])
                if opts is not None:
                    best[key] = opts
    return best, timings


def format_table(table: dict[tuple[str, int, str], FlexOptions], note: str = "") -> str:
    """``table`` as the Python literal that replaces :data:`FLEX_OPTIONS`."""
    lines = [f"# {note}"] if note else []
    lines.append("FLEX_OPTIONS: dict[tuple[str, int, str], FlexOptions] = {")
    for key, o in sorted(table.items()):
        lines.append(f"    {key!r}: FlexOptions(fwd={o.fwd!r}, bwd={o.bwd!r}),")
    lines.append("}")
    return "\n".join(lines)
