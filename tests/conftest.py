import atexit
import gc
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile(
    "default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.register_profile("quick", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QUICK = os.environ.get("TREECOMPILE_QUICK") == "1"  # scripts/test.sh --quick
settings.load_profile(os.environ.get("TREECOMPILE_HYPOTHESIS_PROFILE", "quick" if QUICK else "default"))

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(autouse=True, scope="session")
def _quick_backend():
    """In the quick tier a test that names no backend runs the rewritten graph as it is
    (``backend="eager"``): the passes are what most tests check, and lowering with AOTAutograd,
    the CPU default, triples a capture's time. The full suite (CI) keeps the default, and the
    tests of the lowering name their backend. (In the workers, at their first test: the
    controller never imports treecompile.)"""
    if QUICK:
        from treecompile.compile.wrapper import tree_compile

        tree_compile.__kwdefaults__["backend"] = "eager"
    yield


@pytest.fixture(autouse=True)
def _float64_determinism():
    import torch  # here, not at the top: pytest-xdist's controller starts its workers without it

    torch.manual_seed(0)
    yield


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test, its garbage is collected and what survives is frozen out of later
    collections. torch.compile keeps objects from every capture for the life of the process
    (symbolic-shape nodes, fake-tensor dispatch cache entries, stack summaries: about 10,000
    objects per tiny capture, measured after its wrapper was freed),
    so a worker held millions of them by its end and each of Python's full collections walked
    them all: a sixth of the suite's time went to the garbage collector. Now a collection walks
    only the running test's objects. Frozen objects are never collected, so a module fixture
    left in a reference cycle stays until the worker exits (peak worker memory measured the
    same, 1.5 to 2 GB)."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    # What was frozen is freed when the interpreter exits, by its one last collection (else
    # Triton's bindings report leaks), not by the five full collections pytest makes before
    # (over a worker's millions of objects, seconds each).
    atexit.register(gc.unfreeze)


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared trajectory data not found at {SHARED_DATA}")
    return SHARED_DATA


def quick_selection(items: list) -> tuple[list, list]:
    """``(kept, left out)``: the quick tier (``scripts/test.sh --quick``). Every test function
    runs once, on its first case (the first model of a family, the first parameter set), and
    a test marked ``full`` (a multi-process run, a docs build, a measured memory peak) runs
    only in the full suite; generated examples are capped by the ``quick`` Hypothesis profile."""
    kept, dropped, seen = [], [], set()
    for item in items:
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        if item.get_closest_marker("full") is not None or key in seen:
            dropped.append(item)
        else:
            seen.add(key)
            kept.append(item)
    return kept, dropped


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns the marks into groups
def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's ``--dist loadgroup`` (scripts/test.sh): tests that share a
    module-scoped fixture, or a module's compile cache keyed by the parameter the module names
    in ``XDIST_GROUP_BY``, run on one worker, so what they share is built once; every other
    test goes to whichever worker is free."""
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        shared = sorted(
            name
            for name, defs in item._fixtureinfo.name2fixturedefs.items()
            if any(d.scope == "module" and getattr(d.func, "__module__", None) == module.__name__ for d in defs)
        )
        by = getattr(module, "XDIST_GROUP_BY", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{module.__name__}:{shared[0]}"))
        elif by is not None and by in params:
            item.add_marker(pytest.mark.xdist_group(f"{module.__name__}:{by}={params[by]}"))

    if QUICK:
        items[:], dropped = quick_selection(items)
        config.hook.pytest_deselected(items=dropped)
