#!/usr/bin/env python3
"""Regenerates treecompile/samples/ (the bundled sample trajectories and tokenizer) from ../shared/data.

Usage: python scripts/make_sample_data.py [--shared PATH_TO_SHARED_DATA]

Deterministic: the same input files give byte-identical outputs (checked with --check).
What it writes, and from where, is described in treecompile/samples/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from treecompile.chat.to_tree import render_text  # noqa: E402
from treecompile.data.datasets import GSM8K_SOLVERS, load_gsm8k_solutions, load_tau2, load_tau_bench  # noqa: E402

# The tau-bench airline tasks with the smallest trajectories (total JSON size of their 4
# trials, measured on gpt-4o-airline-even-tasks.json): modest trees, 10 to 16 messages each.
TAU_BENCH_TASKS = (48, 12, 44, 42)
GSM8K_QUESTIONS = 30
# tau2 grok-3-mini trials kept: the model's reasoning makes them the think-mode sample.
TAU2_TRIALS = (0, 1)
VOCAB_SIZE = 2048
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _dump(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def write_tau_bench(shared: Path, out: Path) -> None:
    records = json.loads((shared / "tau_bench" / "gpt-4o-airline-even-tasks.json").read_text(encoding="utf-8"))
    keep = [
        {"task_id": r["task_id"], "trial": r["trial"], "reward": r["reward"], "traj": r["traj"]}
        for task in TAU_BENCH_TASKS
        for r in sorted(records, key=lambda r: r["trial"])
        if r["task_id"] == task
    ]
    # One record per line inside the list: still a plain tau-bench JSON file.
    text = "[\n" + ",\n".join(_dump(r) for r in keep) + "\n]\n"
    (out / "tau_bench_airline_sample.json").write_text(text, encoding="utf-8")


def write_gsm8k(shared: Path, out: Path) -> None:
    src = shared / "gsm8k_example_model_solutions.jsonl"
    raw = [json.loads(line) for line in src.read_text(encoding="utf-8").splitlines()[:GSM8K_QUESTIONS]]
    groups = load_gsm8k_solutions(src, limit=GSM8K_QUESTIONS)
    lines = []
    for (group, convs), r in zip(groups.items(), raw):
        for solver, conv in zip(GSM8K_SOLVERS, convs):
            lines.append(
                _dump({"messages": conv, "group": group, "solver": solver, "is_correct": r[solver]["is_correct"]})
            )
    (out / "gsm8k_sample.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_tau2(shared: Path, out: Path) -> None:
    convs = load_tau2(shared / "tau2" / "tau2fork_blakeelias_grok-3-mini_airline.json")
    lines = []
    for task, trials in convs.items():
        for trial in TAU2_TRIALS:
            lines.append(_dump({"messages": trials[trial], "group": f"tau2-airline-{task}", "trial": trial}))
    (out / "tau2_airline_think_sample.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def training_text(shared: Path):
    """All of the tau-bench airline and GSM8K text, rendered as the chat module renders it."""
    for convs in load_tau_bench(shared / "tau_bench" / "gpt-4o-airline-even-tasks.json").values():
        for conv in convs:
            yield render_text(conv)
    for convs in load_gsm8k_solutions(shared / "gsm8k_example_model_solutions.jsonl").values():
        for conv in convs:
            yield render_text(conv)


def write_tokenizer(shared: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(training_text(shared)), trainer=trainer)
    tok.save(str(out / "sample-tokenizer.json"), pretty=False)


def generate(shared: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_tau_bench(shared, out)
    write_gsm8k(shared, out)
    write_tau2(shared, out)
    write_tokenizer(shared, out)


OUTPUTS = (
    "tau_bench_airline_sample.json",
    "gsm8k_sample.jsonl",
    "tau2_airline_think_sample.jsonl",
    "sample-tokenizer.json",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--out", type=Path, default=REPO / "treecompile" / "samples")
    parser.add_argument("--check", action="store_true", help="regenerate into a temporary folder and compare")
    args = parser.parse_args()
    if not args.shared.is_dir():
        parser.error(f"{args.shared} is not a folder: pass --shared PATH to the shared data")
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            generate(args.shared, Path(tmp))
            bad = [
                name
                for name in OUTPUTS
                if hashlib.sha256((Path(tmp) / name).read_bytes()).digest()
                != hashlib.sha256((args.out / name).read_bytes()).digest()
            ]
        if bad:
            print(f"differ from a fresh generation: {', '.join(bad)}")
            return 1
        print("sample data is up to date")
        return 0
    generate(args.shared, args.out)
    for name in OUTPUTS:
        print(f"{args.out / name}: {(args.out / name).stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
