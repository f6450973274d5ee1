"""The architecture zoo (tests/zoo.py): every model exact on a tree or refused by name.

Each case runs ``tree_compile`` on a tiny float64 model with perturbed weights and
compares loss, per-path log-probs and every gradient with per-path training on two
trees of different lengths, or checks the refusal's first line. Cases that are silently
wrong today for a known class of bug are strict xfails: they fail the day they pass, so
the mark goes with the fix. ``docs/supported-models.md`` is generated from the same table.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import zoo

from treecompile.core.errors import UnsupportedModelError

ROOT = Path(__file__).resolve().parents[1]


def _param(case: zoo.Case):
    marks = [pytest.mark.xfail(strict=True, reason=case.reason)] if case.expect == "xfail" else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in zoo.all_cases()])
def test_zoo_model_is_exact_or_refused_by_name(case, capfd):
    if case.hf:
        pytest.importorskip("transformers")
        if zoo.transformers_version() < case.since:
            pytest.skip(f"{case.id}: transformers {'.'.join(map(str, zoo.transformers_version()))} has no such "
                        f"model (added in {'.'.join(map(str, case.since))})")
    case = case.installed()
    if case.expect == "refused":
        model = case.build()
        twin = copy.deepcopy(model)
        with pytest.raises(UnsupportedModelError) as info:
            zoo.run(case, model)
        first = str(info.value).splitlines()[0]
        assert case.reason in first, first
        # A refusal leaves the model as it was: its buffers, and what it computes on its own.
        buffers = dict(twin.named_buffers())
        assert dict(model.named_buffers()).keys() == buffers.keys()
        for name, b in model.named_buffers():
            assert b.shape == buffers[name].shape and torch.equal(b, buffers[name]), f"buffer {name} changed"
        zoo.assert_unchanged(model, twin, lengths=(7, 12))
    else:
        zoo.run(case)
    # A value the passes judge by running it (a table built at another length) may fail to run:
    # that is the judgement's answer, and nothing of it reaches stderr (an FX module's own call
    # prints the failing line before raising).
    assert "FX-traced Module" not in capfd.readouterr().err


def test_zoo_has_distinct_ids_and_known_outcomes():
    cases = zoo.all_cases()
    assert len({c.id for c in cases}) == len(cases)
    assert {c.expect for c in cases} <= {"exact", "refused", "xfail"}
    assert all(c.reason for c in cases if c.expect != "exact")
    for c in cases:
        if c.before:
            (version, fields) = c.before
            assert len(version) == 2 and set(fields) <= {"expect", "reason", "attention"}, c.id
            old = dataclasses.replace(c, **fields)
            assert old.expect in {"exact", "refused", "xfail"} and (old.expect == "exact" or old.reason), c.id


def test_repository_models_are_causal_as_written():
    """Each repository model, run as an ordinary model, is causal (changing the last tokens
    leaves earlier logits unchanged) unless it is meant to be refused for mixing rows. In
    float64, to rounding: a convolution by FFT sums every row, the later ones times zero
    spectra (1e-15)."""
    import zoo_repos

    for c in zoo_repos.CASES:
        if c.hf or c.expect == "refused":
            continue
        assert zoo_repos.check_causal(c.build()) < 1e-12, c.id


def test_supported_models_page_is_up_to_date():
    sys.path.insert(0, str(ROOT / "scripts"))
    import supported_models

    page = ROOT / "docs" / "supported-models.md"
    assert page.read_text() == supported_models.render(), (
        "docs/supported-models.md is out of date: run python scripts/supported_models.py"
    )
