"""Measuring the peak memory of a step on the CPU: what `treecompile.planning.budget`'s cost model is
checked against (re-exported there as ``treecompile.planning.budget.measure_peak_bytes``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["measure_peak_bytes"]


def measure_peak_bytes(step: Callable[[], Any]) -> int:
    """Peak bytes the CPU allocator holds during ``step()``, above what was live before it.

    Method: ``torch.profiler`` with ``profile_memory=True`` records every allocation and
    free of the CPU allocator with the running total of allocated bytes; the peak is the
    largest running total minus the total before the first event. Frees of blocks
    allocated before profiling are not reported (the profiler warns), so free gradients
    (``zero_grad(set_to_none=True)``) before calling this. Memory that libraries allocate
    outside torch's allocator (oneDNN scratch pads) is not seen.

    Args:
        step: runs the work to measure (e.g. forward, backward, optimizer step).

    Returns:
        Peak bytes above the starting point; add the bytes live before the step.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        fields = e.extra_fields
        if type(fields).__name__.endswith("Allocation") and str(fields.device) == "cpu":
            events.append((e.start_time_ns, fields.total_allocated, fields.alloc_size))
        stack.extend(e.children)
    if not events:
        return 0
    events.sort()
    # total_allocated is process-wide and keeps the blocks allocated in earlier profiling
    # sessions, freed while not profiling: measure from the total before the first event.
    base = events[0][1] - events[0][2]
    return max(0, max(total for _, total, _ in events) - base)
