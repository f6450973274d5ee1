"""Hypothesis strategies for trees: small vocabularies make branching, 1-token nodes,
internal endpoints and duplicate paths common."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def path_sets(draw, max_paths: int = 8, max_len: int = 12, with_masks: bool = True):
    """Returns ``(seqs, weights, masks)``; weights and masks may be None."""
    vocab = draw(st.integers(2, 5))
    seq = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_len)
    base = draw(st.lists(seq, min_size=1, max_size=max_paths))
    seqs = []
    for s in base:
        seqs.append(s)
        kind = draw(st.sampled_from(["none", "none", "prefix", "duplicate", "extend"]))
        if kind == "prefix":
            seqs.append(s[: draw(st.integers(1, len(s)))])
        elif kind == "duplicate":
            seqs.append(list(s))
        elif kind == "extend":
            seqs.append(s + draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4)))
    seqs = draw(st.permutations(seqs))
    weights = None
    if draw(st.booleans()):
        weights = draw(
            st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.25]), min_size=len(seqs), max_size=len(seqs))
        )
    masks = None
    if with_masks and draw(st.booleans()):
        masks = [
            None if draw(st.booleans()) else draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s)))
            for s in seqs
        ]
    return [list(s) for s in seqs], weights, masks


forests = st.lists(path_sets(max_paths=4), min_size=1, max_size=3)
