"""Readers of agent and math datasets' files into conversations grouped by task.

Each returns ``group -> [conversation per sample]``, conversations in the OpenAI message
format that `treecompile.chat.to_tree.tree_from_messages` turns into trees: tau-bench trajectory
files, tau2-bench simulation files and GSM8K's example model solutions.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from treecompile.core.errors import TreeInputError

__all__ = ["GSM8K_SOLVERS", "load_gsm8k_solutions", "load_tau2", "load_tau_bench"]


def load_tau_bench(path: str | Path) -> dict[Any, list[list[dict[str, Any]]]]:
    """Reads a tau-bench trajectory file: ``task_id -> [conversation per trial]``.

    The file is a JSON list of records ``{task_id, trial, reward, info, traj}``, ``traj``
    being OpenAI-format messages. Tasks keep their order of first appearance and each
    task's trials are sorted by ``trial``.
    """
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    if not isinstance(records, list) or not all(isinstance(r, dict) and "traj" in r for r in records):
        raise TreeInputError(f"{path}: not a tau-bench file (expected a JSON list of records with a 'traj' list)")
    grouped: dict[Any, list[tuple[int, list[dict[str, Any]]]]] = {}
    for i, r in enumerate(records):
        grouped.setdefault(r.get("task_id", i), []).append((r.get("trial", 0), r["traj"]))
    return {task: [traj for _, traj in sorted(trials, key=lambda x: x[0])] for task, trials in grouped.items()}


def load_tau2(path: str | Path) -> dict[str, list[list[dict[str, Any]]]]:
    """Reads a tau2-bench simulation file: ``task_id -> [conversation per trial]``.

    tau2 messages map onto the OpenAI format directly: tool calls ``{id, name,
    arguments}`` become ``{id, type, function: {name, arguments}}``, tool results carry
    their call's ``id`` as ``tool_call_id``, and the agent's reasoning (in
    ``raw_data.message.reasoning_content``) becomes ``reasoning_content``. The simulated
    user's reasoning is dropped. The file does not store the agent's exact system
    prompt, so the domain policy (``info.environment_info.policy``) is used as the
    system message.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "simulations" not in data:
        raise TreeInputError(f"{path}: not a tau2 simulation file (expected a JSON object with 'simulations')")
    policy = ((data.get("info") or {}).get("environment_info") or {}).get("policy")
    grouped: dict[str, list[tuple[int, list[dict[str, Any]]]]] = {}
    sims = data["simulations"]
    if not isinstance(sims, list):
        raise TreeInputError(f"{path}: 'simulations' is a {type(sims).__name__}, not a list of simulations")
    for i, sim in enumerate(sims):
        if not isinstance(sim, dict) or not isinstance(sim.get("messages"), list):
            task = sim.get("task_id") if isinstance(sim, dict) else None
            raise TreeInputError(f"{path}: simulation {i} (task {task!r}) has no 'messages' list")
        try:
            grouped.setdefault(str(sim.get("task_id")), []).append((sim.get("trial", 0), _tau2_conversation(sim, policy,
                                                                                                            path)))
        except KeyError as e:
            raise TreeInputError(f"{path}: simulation {i} (task {sim.get('task_id')!r}): a message or tool call "
                                 f"without {e}") from None
        except (TypeError, AttributeError) as e:
            raise TreeInputError(f"{path}: simulation {i} (task {sim.get('task_id')!r}): a message or tool call of "
                                 f"the wrong shape ({type(e).__name__}: {e})") from None
    return {task: [c for _, c in sorted(trials, key=lambda x: x[0])] for task, trials in grouped.items()}


def _tau2_conversation(sim: dict[str, Any], policy: str | None, path: str | Path) -> list[dict[str, Any]]:
    """One tau2 simulation's messages in the OpenAI format (see `load_tau2`)."""
    conv: list[dict[str, Any]] = [{"role": "system", "content": policy}] if policy else []
    names: dict[str, str] = {}
    for m in sim["messages"]:
        role = m.get("role")
        if role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": m.get("content") or None}
            calls = []
            for call in m.get("tool_calls") or []:
                names[call["id"]] = call["name"]
                args = call.get("arguments", {})
                calls.append(
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {
                            "name": call["name"],
                            "arguments": args if isinstance(args, str) else json.dumps(args),
                        },
                    }
                )
            if calls:
                out["tool_calls"] = calls
            reasoning = ((m.get("raw_data") or {}).get("message") or {}).get("reasoning_content")
            if reasoning:
                out["reasoning_content"] = reasoning
            conv.append(out)
        elif role == "tool":
            conv.append(
                {"role": "tool", "tool_call_id": m.get("id"), "name": names.get(m.get("id")), "content": m.get("content")}
            )
        elif role in ("user", "system"):
            conv.append({"role": role, "content": m.get("content")})
        else:
            raise TreeInputError(f"{path}: unknown tau2 message role {role!r}")
    return conv


#: The four model solutions per question in openai/grade-school-math's example_model_solutions.
GSM8K_SOLVERS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def load_gsm8k_solutions(path: str | Path, *, limit: int | None = None) -> dict[str, list[list[dict[str, Any]]]]:
    """Reads GSM8K ``example_model_solutions.jsonl``: ``"gsm8k-{i}" -> 4 conversations``.

    Each conversation is ``[user: question, assistant: solution]``, one per model in
    :data:`GSM8K_SOLVERS`: a GRPO-like group of 4 samples per prompt.
    """
    out: dict[str, list[list[dict[str, Any]]]] = {}
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(_nonblank(f)):
            if limit is not None and i >= limit:
                break
            r = json.loads(line)
            out[f"gsm8k-{i}"] = [
                [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r[s]["solution"]}]
                for s in GSM8K_SOLVERS
            ]
    return out


def _nonblank(lines: Iterable[str]) -> Iterable[str]:
    return (line for line in lines if line.strip())
