"""Micro-batches drawn at random against micro-batches of samples sharing prefixes: POR and step time.

    python benchmarks/prefix_sampler.py             # text
    python benchmarks/prefix_sampler.py --markdown  # the table of docs/benchmarks.md
    python benchmarks/prefix_sampler.py --steps 0   # POR only (seconds)

For each workload, one epoch of micro-batches of ``B`` samples is drawn twice, as a Hugging Face
or TRL ``Trainer`` draws them: by its stock random sampler (``RandomSampler`` cut into batches
of ``B``) and by `treecompile.planning.prefix_sampler.PrefixGroupedSampler` (what
``PrefixGroupingMixin`` and ``TreeSFTTrainer(prefix_grouping=True)`` give it). Each micro-batch
becomes one prefix tree. Reported: the mean POR of the epoch's micro-batches, the mean tree
tokens of a micro-batch (the rows the model computes) and their ratio, and the CPU step time:
forward + backward of one micro-batch through ``tree_compile`` of a Qwen3-shaped model with
random weights (1 layer, hidden 64, 2 heads of 32, vocabulary 2,048; on a CPU its step is
mostly tree attention, whose work grows with the tokens each row sees). Timed: ``--steps``
micro-batches of each epoch spread over their sizes (the epoch's micro-batches sorted by path
tokens, those at evenly spaced quantiles), each run ``--repeats`` times with its fastest run
kept, the two samplers' steps interleaved so that load from other processes falls on both;
one compiled model for every workload, warmed up on three batches first (its compile). The
epoch speedup is the ratio of the path tokens trained per second over the timed steps: an
epoch holds the same samples under both samplers, so it estimates the ratio of the epoch times.

Workloads (samples rendered with `treecompile.chat.conversation.render_conversations` and the
bundled 2,048-id sample tokenizer; loss on the assistant tokens):

* tau-bench airline (GPT-4o, 25 tasks x 4 trials), tau-bench retail (Grok-3, 115 tasks) and
  tau2 airline (2 files of 4 trials): one sample per assistant turn, the conversation up to it
  (turn-level SFT: a conversation's samples share its earlier turns, every sample of a file
  shares the system prompt); the tau-bench airline trials also as whole conversations (they share
  only the system prompt, which a random micro-batch shares already: the control);
* GSM8K: 1,319 questions x 4 model solutions, one sample per solution (a prompt shared by 4);
* synthetic SFT: one 1,024-token system prompt shared by every sample, 48 conversations of 4
  turns (user 48 tokens, assistant 96), one sample per assistant turn; and the same prompt with
  192 single-turn samples (the prompt is all they share: the control).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from treecompile.core.batch import pack
from treecompile.core.tree import TrajectoryTree
from treecompile.planning.prefix_sampler import PrefixGroupedSampler

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
VOCAB = 2048


# ---------------------------------------------------------------------------- workloads


def _rendered(convs: list, samples: str, tok) -> tuple[list[np.ndarray], list[np.ndarray]]:
    from treecompile.chat.conversation import RenderOptions, render_conversations

    paths = render_conversations(convs, tok, RenderOptions(samples=samples, think="last", template="chatml",
                                                           on_drift="ignore"))
    return paths.sequences, paths.masks


def real_workloads(data: Path) -> list[tuple[str, int, list, list]]:
    """``(name, B, sequences, loss masks)`` of each file of ``data``."""
    from treecompile.chat.tokenizer import load_tokenizer
    from treecompile.data import datasets

    tok = load_tokenizer("sample")
    out = []
    airline = data / "tau_bench" / "gpt-4o-airline-even-tasks.json"
    retail = data / "tau_bench" / "grok-3-retail-1trial.json"
    if airline.is_file():
        convs = [c for cs in datasets.load_tau_bench(airline).values() for c in cs]
        out.append(("tau-bench airline, turns", 4, *_rendered(convs, "assistant_turns", tok)))
        out.append(("tau-bench airline, trials", 4, *_rendered(convs, "conversation", tok)))
    if retail.is_file():
        convs = [c for cs in datasets.load_tau_bench(retail).values() for c in cs]
        out.append(("tau-bench retail, turns", 4, *_rendered(convs, "assistant_turns", tok)))
    tau2 = sorted((data / "tau2").glob("*.json"))
    if tau2:
        convs = [c for f in tau2 for cs in datasets.load_tau2(f).values() for c in cs]
        out.append(("tau2 airline, turns", 4, *_rendered(convs, "assistant_turns", tok)))
    gsm8k = data / "gsm8k_example_model_solutions.jsonl"
    if gsm8k.is_file():
        convs = [c for cs in datasets.load_gsm8k_solutions(gsm8k).values() for c in cs]
        out.append(("GSM8K, 4 solutions per question", 8, *_rendered(convs, "conversation", tok)))
    return out


def synthetic_workloads(seed: int = 0) -> list[tuple[str, int, list, list]]:
    """A 1,024-token system prompt: under 48 conversations of 4 turns (a sample per turn), and
    under 192 single-turn samples."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, 1024).tolist()

    def turn() -> tuple[list[int], list[int]]:
        user, reply = rng.integers(0, VOCAB, 48).tolist(), rng.integers(0, VOCAB, 96).tolist()
        return user + reply, [0] * 48 + [1] * 96

    out = []
    for name, convs, turns in (("synthetic SFT, system prompt + 4 turns", 48, 4),
                               ("synthetic SFT, system prompt + 1 turn", 192, 1)):
        seqs, masks = [], []
        for _ in range(convs):
            ids, mask = list(system), [0] * len(system)
            for _ in range(turns):
                t, m = turn()
                ids, mask = ids + t, mask + m
                seqs.append(np.array(ids))
                masks.append(np.array(mask))
        out.append((name, 8, seqs, masks))
    return out


# ---------------------------------------------------------------------------- measuring


def random_batches(n: int, size: int, seed: int) -> list[list[int]]:
    """One epoch of the stock ``Trainer``'s batches: ``RandomSampler`` cut into ``size``."""
    sampler = torch.utils.data.RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))
    return list(torch.utils.data.BatchSampler(sampler, size, drop_last=False))


def prefix_batches(seqs: Sequence, size: int, seed: int) -> list[list[int]]:
    """One epoch of the batches a ``Trainer`` with `PrefixGroupedSampler` draws."""
    return list(torch.utils.data.BatchSampler(PrefixGroupedSampler(seqs, size, seed=seed), size, drop_last=False))


def _tree(seqs, masks, batch) -> TrajectoryTree:
    return TrajectoryTree.from_sequences([seqs[i] for i in batch], loss_masks=[masks[i] for i in batch])


def _model():
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=1 << 17)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _step_seconds(compiled, tree: TrajectoryTree, repeats: int = 1) -> float:
    """The fastest of ``repeats`` steps on ``tree`` (the others were slowed by something else)."""
    batch = pack([tree], warn_por=False)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        compiled.zero_grad()
        compiled(batch).loss.backward()
        best = min(best, time.perf_counter() - start)
    return best


def _spread(batches: list[list[int]], seqs: Sequence, k: int) -> list[list[int]]:
    """``k`` of the epoch's micro-batches spread over their sizes: by path tokens, the ones at the
    quantiles ``(2j + 1) / 2k`` (a sample stratified by size: a step's time grows with it)."""
    by_size = sorted(batches, key=lambda b: sum(len(seqs[i]) for i in b))
    if k >= len(by_size):
        return by_size
    return [by_size[int((2 * j + 1) * len(by_size) / (2 * k))] for j in range(k)]


def measure(workloads, steps: int, seed: int, repeats: int = 2, log=print) -> list[dict]:
    import treecompile as tc

    compiled = tc.tree_compile(_model()) if steps else None
    rows, warm = [], False
    for name, size, seqs, masks in workloads:
        draws = {"random": random_batches(len(seqs), size, seed), "prefix": prefix_batches(seqs, size, seed)}
        row = {"workload": name, "samples": len(seqs), "B": size}
        for kind, batches in draws.items():
            stats = [_tree(seqs, masks, b).stats() for b in batches]
            row[f"{kind} por"] = float(np.mean([s.por for s in stats]))
            row[f"{kind} tokens"] = float(np.mean([s.tree_tokens for s in stats]))
        if steps:
            if not warm:  # compile, then the recompile for dynamic sizes, then one more
                for b in (draws["prefix"][0], draws["random"][0], draws["prefix"][1]):
                    _step_seconds(compiled, _tree(seqs, masks, b))
                warm = True
            picks = {kind: _spread(batches, seqs, steps) for kind, batches in draws.items()}
            times: dict[str, list[float]] = {"random": [], "prefix": []}
            for k in range(steps):
                for kind in ("random", "prefix"):
                    if k < len(picks[kind]):
                        times[kind].append(_step_seconds(compiled, _tree(seqs, masks, picks[kind][k]), repeats))
            for kind in times:
                timed = picks[kind]
                row[f"{kind} ms"] = 1000 * float(np.mean(times[kind]))
                # Path tokens a second over the timed micro-batches: an epoch has the same path tokens
                # under both samplers, so the ratio of these rates is the ratio of the epoch times.
                row[f"{kind} path/s"] = sum(len(seqs[i]) for b in timed for i in b) / sum(times[kind])
        log(f"  {name}: done", file=sys.stderr)
        rows.append(row)
    return rows


def table(rows: list[dict], markdown: bool) -> str:
    timed = "random ms" in rows[0]
    head = ["workload", "samples", "B", "POR random", "POR prefix", "tree tok random", "tree tok prefix",
            "tokens ratio"]
    if timed:
        head += ["step ms random", "step ms prefix", "epoch speedup"]
    lines = []
    for r in rows:
        cells = [r["workload"], f"{r['samples']:,}", str(r["B"]), f"{r['random por']:.3f}", f"{r['prefix por']:.3f}",
                 f"{r['random tokens']:,.0f}", f"{r['prefix tokens']:,.0f}",
                 f"{r['random tokens'] / r['prefix tokens']:.2f}x"]
        if timed:
            cells += [f"{r['random ms']:,.0f}", f"{r['prefix ms']:,.0f}",
                      f"{r['prefix path/s'] / r['random path/s']:.2f}x"]
        lines.append(cells)
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in [head, *lines])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help="the shared data folder (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=6, help="micro-batches timed per sampler and workload (0: none)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each timed micro-batch; the fastest counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    from treecompile.bench.trees import environment

    start, load = time.perf_counter(), os.getloadavg()[0]
    command = "python benchmarks/prefix_sampler.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])
                                                       ).rstrip()
    env = environment(command)
    workloads = (real_workloads(args.data) if args.data.is_dir() else []) + synthetic_workloads(args.seed)
    rows = measure(workloads, args.steps, args.seed, args.repeats)
    bullet = "- " if args.markdown else ""
    print(f"{bullet}device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
          f"treecompile {env['treecompile']}, python {env['python']}")
    print(f"{bullet}command: {env['command']}")
    print(f"{bullet}date: {env['date']}; {time.perf_counter() - start:.0f} s; load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    print()
    print(table(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
