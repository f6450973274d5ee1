"""The first-call probe's cost against the first training step it rides on.

    python benchmarks/probe_cost.py            # the three models below
    python benchmarks/probe_cost.py --small    # the bench model only

For each model: one first step (capture, passes, lowering, forward, backward) on a tree at
POR 0.5 with the probe on (the default), and the probe's own time from ``compiled.probed``.
The models are Qwen3-shaped with random weights, in float32: the `bench --quick` model (2
layers, hidden 128; 16 paths of 128 tokens, the `treecompile bench` workload), one with
Qwen3-0.6B's dims (28 layers, hidden 1024) and one with Qwen3-1.7B's, the GPU benchmark's
model (28 layers, hidden 2048), on 16 paths of 32 tokens (a CPU step of these is slow). The
probe runs the rewritten graph eagerly, without gradients, on a forest of at most about 30
rows built from the batch's tokens, four to five times: its cost follows the model, not the
batch.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

import torch

import treecompile as tc
from treecompile.bench.trees import synthetic_tree


def _model(name: str):
    import transformers

    if name == "bench-quick":
        cfg = transformers.Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    elif name == "qwen3-0.6b-dims":
        cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, tie_word_embeddings=True)
    else:  # Qwen3-1.7B's dimensions
        cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().train()


def measure(name: str) -> dict:
    model = _model(name)
    vocab = model.config.vocab_size
    tree = synthetic_tree(16, 128 if name == "bench-quick" else 32, 0.5, vocab=vocab)
    batch = tc.pack([tree])
    compiled = tc.tree_compile(model)
    start = time.perf_counter()
    compiled(batch).loss.backward()
    first = time.perf_counter() - start
    (report,) = compiled.probed
    return {"model": name, "rows": batch.num_tokens, "first_step_s": first, "probe_s": report.seconds,
            "probe_rows": report.rows, "share": report.seconds / first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the bench model only")
    args = ap.parse_args()
    import transformers

    print(f"device: CPU {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, python {platform.python_version()}")
    print(f"command: python benchmarks/probe_cost.py{' --small' if args.small else ''}")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("| model | tree rows | first step s | probe s | probe rows | probe share of the first step |")
    print("|---|---|---|---|---|---|")
    for name in ("bench-quick",) if args.small else ("bench-quick", "qwen3-0.6b-dims", "qwen3-1.7b-dims"):
        r = measure(name)
        print(f"| {r['model']} | {r['rows']} | {r['first_step_s']:.1f} | {r['probe_s']:.3f} | {r['probe_rows']} | "
              f"{100 * r['share']:.1f}% |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
