"""treecompile.bench.profile_cuda on the CPU: a tiny model's step, profiled and reported."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import warnings  # noqa: E402

from testing import eager_default_lowering  # noqa: E402

from treecompile.bench.profile_cuda import (  # noqa: E402
    ProfileConfig, _category, _union_us, gap_classes, markdown_report, profile_step, sync_lines, sync_sites)


def test_categories_and_interval_union():
    assert _category("triton_tem_fused_flex_attention_backward_zeros_3") == "attention backward"
    assert _category("triton_tem_fused_flex_attention_0") == "attention forward"
    assert _category("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmuls"
    assert _category("_row_logprobs_kernel") == _category("_row_grad_kernel") == "LM head log-probs"
    assert _category("triton_poi_fused_add_mul_0") == "normalisation, activations and other fused kernels"
    assert _category("Memcpy DtoD (Device -> Device)") == "copies and fills"
    assert _category("something unexpected") == "other"
    assert _union_us([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4


def test_idle_gaps_are_summed_by_length_between_overlapping_intervals():
    # busy 0-3 (two overlapping intervals), then gaps of 10 us, 500 us and 3.4 ms (microseconds)
    gaps = gap_classes([(0, 2), (1, 3), (13, 1000), (1500, 1600), (5.0e3, 5.1e3)])
    assert gaps == {"under 20 us": 10, "20 us to 1 ms": 500, "over 1 ms": 3400}


def test_profile_of_a_tiny_step_on_cpu():
    cfg = ProfileConfig(model="tiny", path_tokens=256, paths=4, por=0.5, dtype="float32", warmup=1, steps=1, top=5)
    with eager_default_lowering():  # the report's making is tested, not the lowering's profile
        r = profile_step(cfg, device="cpu")
    assert r["rows"] < r["path_tokens"] == 256 and r["compiles_during_profile"] == 0
    assert r["step_wall_ms"] > 0 and abs(sum(r["categories_ms"].values()) - r["busy_ms"]) < 1e-6 * r["busy_ms"] + 1e-9
    assert "matmuls" in r["categories_ms"] and len(r["top"]) == 5
    text = markdown_report(r)
    assert "| step, wall clock |" in text and "| category | ms per step | share |" in text
    assert "host synchronisations" not in text  # CUDA only


def test_sync_lines_name_the_line_that_synchronised():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            warnings.warn_explicit("called a synchronizing CUDA operation\nstack", UserWarning, "batch.py", 210)
        warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, "compile.py", 377)
        warnings.warn_explicit("something else", UserWarning, "other.py", 1)
    lines = sync_lines(caught)
    assert lines == ["batch.py:210: called a synchronizing CUDA operation"] * 2 + [
        "compile.py:377: called a synchronizing CUDA operation"]
    assert sync_sites(lines) == [("batch.py:210", 2), ("compile.py:377", 1)]
