"""Row locality by proof: where each value's rows are, node by node, or why a node mixes them.

On a packed tree row an op is exact iff every row of its result is computed from the same
row of its inputs and from values that depend on no row: then, by induction over the
graph, each row holds what per-path training computes for that token. This package proves
that op by op. It interprets the graph over an abstract domain (:mod:`.domain`): every
tensor value carries a :class:`Rows` (which dim holds the packed rows, how they sit inside
it, whether they are all rows or a data-chosen subset of them, whether its values are row
indices) or None (the value depends on no row: parameters, constants, sizes). Each op
family has a rule, one family per module, all in one table (`RULES`); the walk
(:mod:`.walk`) applies them in graph order. An op that no rule names is refused as soon
as it sees a row: nothing is assumed safe because no list of dangers names it.

| module | families |
|---|---|
| :mod:`.elementwise` | element-wise ops, casts, shape reads, host reads, ``torch.vmap`` |
| :mod:`.shape` | views, permutations, expansions, joins and splits, padding |
| :mod:`.index` | indexing, gathers and scatters, rows chosen by ``nonzero`` |
| :mod:`.reduce` | reductions, scans, sorts and softmaxes along dims, norms |
| :mod:`.contract` | products, attention, lookups, convolutions, pooling |
| :mod:`.create` | new tensors, ``arange``, ops refused by name |
| :mod:`.random` | dropout and random draws (and whether a call draws) |
| :mod:`.grouped` | tokens grouped by a key: sort-based expert dispatch (``argsort``, ``histc``, ``split``) |

``passes/README.md`` lists the rules in one table (`rule_table`, checked by the tests).
"""

from treecompile.passes.rows import contract, create, elementwise, index, random, reduce, shape  # noqa: F401 (the table)
from treecompile.passes.rows import grouped
from treecompile.passes.rows.domain import (
    IDS,
    ONE_ROW,
    RULES,
    TABLE,
    NotRowLocal,
    RowEnv,
    Rows,
    Rule,
    op_key,
)
from treecompile.passes.rows.walk import row_family, row_states

grouped.register()

__all__ = ["Rows", "IDS", "TABLE", "NotRowLocal", "RowEnv", "row_states", "row_family", "op_key", "RULES", "Rule",
           "ONE_ROW", "FAMILIES", "rule_table"]

#: What each rule family proves (a row of the table in passes/README.md).
FAMILIES: dict[str, str] = {
    "pointwise": "each result element reads the same element of each input: the inputs' rows must be the same rows "
                 "at the same (broadcast) dim; row ids may not be computed with",
    "dropout": "as element-wise; in training mode with `p > 0` it draws random numbers, refused before the rules "
               "run unless `tree_compile(dropout=\"shared\")`",
    "random draw": "as element-wise (`bernoulli`, in-place draws), a new tensor (`rand`) or one shaped like its input "
                   "(`rand_like`); every call draws, refused before the rules run unless `dropout=\"shared\"`",
    "cast": "the same values in another dtype, device or memory: the rows (and row ids) stay",
    "meta": "reads a shape or checks a condition: no tensor, nothing moves",
    "host read": "a value read on the host (`item`, `tolist`): refused if the tensor has rows",
    "vmap": "`torch.vmap` over the rows sees one row at a time (they return at its end); over another dim the rows "
            "move past it",
    "complex view": "a view as complex numbers: the rows may not be the last dim",
    "attribute": "`x.T`, `x.mT`, `x.real`: as the view they are; any other attribute of rows is refused",
    "view": "a reshape keeps the elements' flat order: the rows stay rows if a result dim holds the whole row index "
            "(alone or merged with neighbours, tracked by its inner stride); a view that cuts a row across dims is "
            "refused",
    "permute": "moves the rows' dim",
    "unsqueeze": "shifts the rows' dim",
    "squeeze": "shifts the rows' dim (the rows are never size 1)",
    "expand": "new leading dims shift the rows; a repeat tiles whole dims; a tensor without rows expanded to S "
              "holds the same value in every row",
    "repeat_interleave": "along the rows, each row's copies sit together (inner stride times the repeats)",
    "broadcast_tensors": "as element-wise broadcasting",
    "cat": "along another dim, the parts' rows line up; along the rows it changes the length: refused (one part: a copy)",
    "stack": "a new dim shifts the rows; the parts' rows line up",
    "split": "along another dim each piece keeps the rows; along the rows: refused",
    "unfold": "windows along another dim; along the rows: refused",
    "pad": "padding another dim; on the rows' dim only literally `(0, 0)`",
    "mask": "`tril` / `triu` over the rows: refused (a mask built from the row index)",
    "getitem": "slices and integers on other dims; on the rows only the full slice; a tensor index on the rows must "
               "hold row ids (`arange(S)`, or the ids `nonzero` returns, giving a selection); a table read at rows' "
               "values (`table[ids]`) gives rows; a bound computed from the length on another dim is refused "
               "unless the dim comes out whole (`[:T]` of a dim of size 1); a boolean mask over dims before the rows "
               "(X-MOD's `x[lang == i]` over the batch) chooses whole rows, its count no count of rows, unless its "
               "values read a size of the sequence",
    "select": "another dim; one row by its index is refused",
    "narrow": "the identity on the rows' dim; another dim with bounds free of the length",
    "setitem": "the written values' rows must be the rows of the region written",
    "mutation": "`index_put_`: as `setitem`",
    "index_select": "the rows picked by row ids; a table (without rows) read at rows' values gives rows",
    "gather": "along another dim, index and input have the same rows; along the rows only with an index of row ids "
              "(each entry the id of its own row, `ids.reshape(-1, 1).expand(-1, D)`): each entry reads its row",
    "scatter": "into the rows' dim only at row ids with the values of those rows; along another dim index, source "
               "and target have the same rows",
    "masked_select": "a 1-D row mask over 1-D rows: a selection",
    "nonzero": "the ids of non-zero entries of a row tensor: a selection of rows (row ids in its row column, data in "
               "the others); a mask computed again by the same element-wise op from the same tensors, with no write "
               "between, is the same selection (`y[idx == i] = f(x[idx == i])`)",
    "grouped": "`argsort` (or `sort`: the keys and the ids) of every (token, slot) key, the indices of a top-k or argmax over `E` groups, is a grouped "
               "selection whose values are flat ids (`// k` gives the token's row id); `histc` / `bincount` with one bin "
               "per group counts it (the counts are sizes only: `.item()` of one, never a value); `split` at those "
               "counts in order gives one piece per group, `cat` of every piece in order the selection again, zeros "
               "of `length - sum(counts)` rows are none; `vstack` is `cat` along dim 0; any other `argsort` or `sort` is a "
               "sort along a dim",
    "index": "`where(cond)` is `nonzero`; `where(c, x, y)` is element-wise",
    "along a dim": "reductions, scans, sorts, softmaxes, flips, rolls, differences, FFTs along dims that are not the "
                   "rows (without a dim: every dim, refused with rows)",
    "norm": "statistics over dims that are not the rows (`layer_norm`, `rms_norm` over the last dims; group and "
            "instance norm only with the rows as samples; batch norm only in evaluation with running statistics)",
    "recurrent cell": "one step of `gru_cell`, `lstm_cell`, `rnn_tanh_cell`, `rnn_relu_cell` over a batch of rows: "
                      "each row with its own state (the rows on the batch dim of the input and the states), the "
                      "weights without rows",
    "contraction": "`matmul`, `einsum`, `linear` ... as an einsum: every operand's rows on one letter, kept in the "
                   "result; contracting it or two row letters (an [S, S] product) is refused",
    "attention": "`scaled_dot_product_attention` left in the graph: rows as a batch dim or only the queries; over "
                 "the keys refused (a causal one was rewritten before)",
    "lookup": "`embedding`, `one_hot`: the index's rows, plus a dim",
    "convolution": "rows as the batch dim, or on a spatial dim whose kernel is 1 wide with stride 1 and no padding "
                   "(a pointwise conv1d); over the channels or wider along the rows refused",
    "pooling": "rows as batch or channels; over the pooled dims refused",
    "like": "`zeros_like(x)` ...: x's rows, the same value in each",
    "creation": "`zeros(1, S, D)` ...: one value in every row; two dims of S are an [S, S] mask (refused); "
                "`arange(S)` is the row ids; `arange(c * S)`, `arange(S + c)` or `arange(max(c * S, n))` a table read "
                "at positions; any other arange or `linspace` over the rows is refused",
    "refused": "named ops over rows that no tree form exists for here (recurrent layers, a loss inside the model, "
               "an attention or sequence kernel left unrewritten)",
}


def rule_table() -> str:
    """The rule table of passes/README.md (Markdown), from `RULES` and `FAMILIES`."""
    ops: dict[str, set[str]] = {}
    modules: dict[str, str] = {}
    for name, rule in RULES.items():
        ops.setdefault(rule.family, set()).add(name)
        modules.setdefault(rule.family, rule.infer.__module__.rsplit(".", 1)[-1])
    rows = ["| family | module | ops | row-local when |", "|---|---|---|---|"]
    for family, what in FAMILIES.items():
        names = sorted(ops.get(family, ()))
        shown = ", ".join(f"`{n}`" for n in names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
        rows.append(f"| {family} | `rows/{modules.get(family, '?')}.py` | {shown} | {what} |")
    return "\n".join(rows) + "\n"
