"""The tree primitives (treecompile/core/preorder.py) against definitions by ancestor sets."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from treecompile.core.preorder import climb, preorder_violation, root_path_sum, subtree_max, subtree_sum


@st.composite
def preorder_forests(draw):
    """``parent`` of a random forest numbered in preorder: each node's parent is -1 or a node
    on the path of open ancestors of the node before it."""
    n = draw(st.integers(1, 40))
    parent, open_path = [], []
    for v in range(n):
        keep = draw(st.integers(0, len(open_path)))  # how many open ancestors stay open
        open_path = open_path[:keep]
        parent.append(open_path[-1] if open_path else -1)
        open_path.append(v)
    values = draw(st.lists(st.integers(-5, 9), min_size=n, max_size=n))
    return np.array(parent, dtype=np.int64), np.array(values, dtype=np.int64)


def ancestors_or_self(parent, v):
    out = {v}
    while parent[v] >= 0:
        v = int(parent[v])
        out.add(v)
    return out


@given(preorder_forests())
def test_primitives_equal_their_definitions(case):
    parent, values = case
    n = len(parent)
    anc = [ancestors_or_self(parent, v) for v in range(n)]
    below = [[u for u in range(n) if v in anc[u]] for v in range(n)]
    assert subtree_sum(parent, values).tolist() == [int(values[b].sum()) for b in below]
    assert subtree_max(parent, values).tolist() == [int(values[b].max()) for b in below]
    assert root_path_sum(parent, values).tolist() == [int(values[sorted(a)].sum()) for a in anc]
    for v in range(n):
        chain = list(climb(parent, v))
        assert chain == sorted(anc[v], reverse=True) and chain[-1] in np.flatnonzero(parent < 0)


def test_climb_stops_before_a_marked_node_and_sees_marks_made_on_the_way():
    parent = np.array([-1, 0, 1, 1, 0])
    seen = np.zeros(5, dtype=bool)
    walked = []
    for end in (2, 3, 4):
        for v in climb(parent, end, stop=seen):
            seen[v] = True
            walked.append(v)
    assert walked == [2, 1, 0, 3, 4]  # each node once
    assert list(climb(parent, 2, stop=seen)) == []


def test_inputs_are_left_untouched():
    parent, values = np.array([-1, 0, 0]), np.array([1, 2, 3])
    subtree_sum(parent, values), subtree_max(parent, values), root_path_sum(parent, values)
    assert values.tolist() == [1, 2, 3]


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=30))
def test_preorder_violation_equals_contiguous_subtrees(draws):
    """Any forest with earlier parents: accepted exactly when every subtree is a contiguous range."""
    parent = np.array([d % (v + 1) - 1 for v, d in enumerate(draws)], dtype=np.int64)  # -1 or an earlier node
    n = len(parent)
    anc = [ancestors_or_self(parent, v) for v in range(n)]
    contiguous = all(
        (below := [u for u in range(n) if v in anc[u]]) == list(range(v, v + len(below))) for v in range(n)
    )
    why = preorder_violation(parent)
    assert (why is None) == contiguous, (parent.tolist(), why)
    if why is not None:
        assert "(not preorder" in why


@given(preorder_forests())
def test_preorder_forests_pass_and_bad_parents_are_named(case):
    parent, _ = case
    assert preorder_violation(parent) is None
    later = parent.copy()
    later[0] = len(parent) - 1 if len(parent) > 1 else 0
    assert preorder_violation(later).startswith(f"node 0 has parent {int(later[0])}: a parent must be an earlier node")
