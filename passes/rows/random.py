"""Row rules: ops that draw random numbers, and whether a call draws.

Dropout draws when ``p > 0`` in training mode; the other ops here draw on every call. Their
rows follow what they compute (dropout and the in-place draws element by element, ``rand``
as a new tensor, ``rand_like`` shaped like its input), but a tree draws one number per row,
shared by every path through it, where per-path training draws one per path: another
estimator. `draws` says whether a call draws; `treecompile.passes.verify` refuses it unless
``tree_compile(dropout="shared")`` accepts it. `attention_dropout` is the refusal of dropout
inside an attention the tree rewrites (its kernels draw nothing, so ``"shared"`` cannot help).
"""

from __future__ import annotations

from typing import Any

from torch import fx
from treecompile.core.errors import UnsupportedModelError
from treecompile.passes._graph import describe, location_of, source_of
from treecompile.passes.rows.create import creation, like
from treecompile.passes.rows.domain import _register
from treecompile.passes.rows.elementwise import pointwise

__all__ = ["DRAWS", "DROPOUTS", "attention_dropout", "draws", "random_refusal"]

#: Dropout ops and the positions of their ``(p, train)`` arguments.
DROPOUTS: dict[str, tuple[int, int]] = {
    name: (1, 2) for name in ("dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d "
                              "native_dropout feature_dropout").split()}
#: Ops that draw on every call.
DRAWS = frozenset("bernoulli bernoulli_ rand randn rand_like randn_like randint randint_like normal normal_ uniform_ "
                  "exponential_ geometric_ cauchy_ log_normal_ random_ multinomial randperm".split())

# ``feature_dropout`` gets no row rule (it never had one): it is refused wherever it sees rows.
_register("dropout", [name for name in DROPOUTS if name != "feature_dropout"])(pointwise)
_register("random draw", "bernoulli normal uniform exponential geometric log_normal cauchy random")(pointwise)
_register("random draw", "rand randn", sizes=("all",))(creation)
_register("random draw", "rand_like randn_like randint_like")(like)


def draws(node: fx.Node) -> str | None:
    """What random draw ``node`` makes (``"dropout (p=0.1) in training mode"``, ``"a random draw
    (randn)"``), or None: not a random op, or a dropout with ``p = 0`` or out of training mode."""
    name = getattr(node.target, "__name__", str(node.target)).split(".")[-1]
    if name in DROPOUTS:
        i_p, i_train = DROPOUTS[name]
        p = node.kwargs.get("p", node.args[i_p] if len(node.args) > i_p else 0.5)
        train = node.kwargs.get("training", node.kwargs.get("train",
                                node.args[i_train] if len(node.args) > i_train else True))
        if not (isinstance(p, (int, float)) and p > 0 and train is not False):
            return None
        return f"dropout (p={p}) in training mode"
    return f"a random draw ({name})" if name in DRAWS else None


def random_refusal(node: fx.Node, what: str) -> UnsupportedModelError:
    """The refusal of a random op the caller did not accept (``dropout="shared"``)."""
    return UnsupportedModelError(
        f"treecompile will not train this model on a tree without being told to: {describe(node)} at "
        f"{location_of(node)} is {what}. Per-path training draws it for each path; a tree draws it once "
        "for each shared token, for all the paths through it (another estimator, not the same numbers).\n"
        f"  at {source_of(node)}\n"
        "Call model.eval() or set the dropout to 0 for exact per-path results, or pass "
        "tree_compile(model, dropout=\"shared\") to train with one draw per tree token.")


def attention_dropout(node: fx.Node, p: Any, setting: str) -> UnsupportedModelError:
    """The refusal of dropout ``p`` inside an attention (``setting``: how the model turns it off)."""
    return UnsupportedModelError(
        f"{describe(node)} at {source_of(node)}: attention dropout {p} cannot match per-path training (it is random "
        f"per call, and the tree's attention kernels draw nothing); use model.eval() or {setting}")
