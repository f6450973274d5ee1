"""GRPO on trees vs. GRPO path by path: the same training, step for step, in float64.

A tiny GPT-2 model (random weights, vocabulary 16) learns a synthetic task: for each
prompt it samples a group of completions, each rewarded by the share of its tokens below 4.
Each step does GRPO: group-normalised advantages, then two PPO epochs on the clipped
surrogate (asymmetric clip, dual-clip) with a k3 KL penalty against the initial model.

The run is done twice from the same weights and seed: once path by path (every completion
through the unmodified model), once on trees (each group's prompt computed once, via
``treecompile.tree_compile``). Sampling in each run uses its own model, so the two only stay
on the same trajectory if every update is equal. The script prints both loss curves, the
largest parameter difference and the wall-time ratio.

    python examples/grpo_tree.py [--steps 10]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import treecompile
from treecompile.compile.extract import logprobs as tree_logprobs
from treecompile.core.reference import path_logprobs
from treecompile.rl.losses import PolicyLossConfig, per_path_policy_loss, policy_loss
from treecompile.rl.data import RLCollator, RLRecord

VOCAB = 16
PROMPTS = [[5, 9, 12, 7], [3, 14, 6, 6]]
GROUP = 4
COMPLETION_LEN = 5
EPOCHS = 2
CONFIG = PolicyLossConfig(eps_low=0.2, eps_high=0.28, clip_c=3.0, kl_coef=0.05, kl_estimator="k3")
MODE = "seq-mean-token-mean"


def make_model() -> torch.nn.Module:
    """A tiny GPT-2 with random weights, float64, eval mode (no dropout).

    GPT-2 computes everything in the parameters' dtype. (Models whose RMSNorm upcasts to
    float32 put a ~1e-7 rounding floor under any float64 comparison, which Adam then carries
    into the parameters; the tree is exact either way, but the check would not be.)
    """
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg).double().eval()


@torch.no_grad()
def sample(model: torch.nn.Module, step: int) -> list[RLRecord]:
    """GROUP completions per prompt from the model, with a seed fixed per step."""
    gen = torch.Generator().manual_seed(1000 + step)
    records = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt] * GROUP)
        for _ in range(COMPLETION_LEN):
            probs = torch.softmax(model(input_ids=ids, use_cache=False).logits[:, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
        for row in ids.tolist():
            completion = row[len(prompt):]
            reward = sum(t < 4 for t in completion) / len(completion)
            records.append(RLRecord(prompt_ids=prompt, completion_ids=completion, reward=reward))
    return records


def train(model: torch.nn.Module, ref_model: torch.nn.Module, steps: int, on_trees: bool):
    """GRPO; returns the loss of every optimizer step and the training time of each step."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    compiled = treecompile.tree_compile(model) if on_trees else None
    collator = RLCollator(max_tokens=4096, loss_agg_mode=MODE)
    losses, seconds = [], []
    for step in range(steps):
        records = sample(model, step)
        t0 = time.perf_counter()
        samples = collator.samples(records)  # one tree per prompt, GRPO advantages
        paths = [p for s in samples for p in s.tree.paths()]
        if on_trees:
            # Old- and reference-policy passes: one no-grad tree pass each.
            old = tree_logprobs(compiled, [s.tree for s in samples], entropy=False).per_path
            ref = tree_logprobs(ref_model, [s.tree for s in samples], entropy=False).per_path
        else:
            with torch.no_grad():
                old = [path_logprobs(model, p.tokens) for p in paths]
                ref = [path_logprobs(ref_model, p.tokens) for p in paths]
        advantages = [a for s in samples for a in s.advantages]
        if on_trees:
            rl = treecompile.rl.losses.build_rl_batch([s.tree for s in samples], advantages=advantages, old_logprobs=old,
                                               ref_logprobs=ref, loss_agg_mode=MODE)
        for _ in range(EPOCHS):
            opt.zero_grad()
            if on_trees:
                loss = policy_loss(compiled(rl.batch).logprobs, rl, CONFIG).loss
            else:
                loss = per_path_policy_loss(
                    [path_logprobs(model, p.tokens) for p in paths], [p.loss_mask for p in paths],
                    advantages=advantages, old_logprobs=old, ref_logprobs=ref, config=CONFIG, loss_agg_mode=MODE,
                )
            loss.backward()
            opt.step()
            losses.append(loss.item())
        seconds.append(time.perf_counter() - t0)
    return losses, seconds


def run(steps: int = 10) -> dict:
    """Both runs from the same initial weights; returns their curves, diffs and times."""
    base = make_model()
    ref_model = copy.deepcopy(base)
    per_path, tree = copy.deepcopy(base), copy.deepcopy(base)
    path_losses, path_s = train(per_path, ref_model, steps, on_trees=False)
    tree_losses, tree_s = train(tree, ref_model, steps, on_trees=True)
    param_diff = max((a - b).abs().max().item() for a, b in zip(per_path.parameters(), tree.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(per_path.parameters(), base.parameters()))
    loss_diff = max(abs(a - b) for a, b in zip(path_losses, tree_losses))
    return {"path_losses": path_losses, "tree_losses": tree_losses, "loss_diff": loss_diff,
            "param_diff": param_diff, "param_moved": moved, "path_seconds": path_s, "tree_seconds": tree_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    r = run(args.steps)
    print(f"{'opt step':>8} {'per-path loss':>22} {'tree loss':>22}")
    for i, (a, b) in enumerate(zip(r["path_losses"], r["tree_losses"])):
        print(f"{i:>8} {a:>22.15f} {b:>22.15f}")
    print(f"max |loss diff| {r['loss_diff']:.3e}; max |param diff| {r['param_diff']:.3e} "
          f"(parameters moved by up to {r['param_moved']:.3e})")
    p, t = r["path_seconds"], r["tree_seconds"]
    print(f"wall time, all steps: per-path {sum(p):.2f}s, tree {sum(t):.2f}s (tree/per-path {sum(t) / sum(p):.2f}; "
          "the tree run's first step includes its one-off compiles)")
    if len(p) > 1:
        print(f"wall time, steps 1..: per-path {sum(p[1:]):.2f}s, tree {sum(t[1:]):.2f}s "
              f"(tree/per-path {sum(t[1:]) / sum(p[1:]):.2f})")


if __name__ == "__main__":
    main()
