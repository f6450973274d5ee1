"""The Triton fused log-prob kernels (kernels/logprobs/fused_triton.py) against the torch op.

The kernels run here under Triton's CPU interpreter, in a child process
(``tests/triton_interpreter_cases.py``): Triton reads ``TRITON_INTERPRET`` when a kernel is
decorated, so the variable must be set before import, and set in this process it would turn
every later Triton kernel into an interpreted one. The GPU run of the same kernels is in
``tests/gpu/test_gpu_fused_head.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_fused_logprobs import TOLERANCES

from treecompile.kernels.logprobs.fused import KERNELS, default_kernel, fused_target_logprobs

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("triton_interpreter_cases.py")
EXPECTED = [
    f"{case}-float32-{variant}"
    for case in ("R1-V5", "R9-V97-B32", "R12-V64-B16", "R10-V33-sparse")
    for variant in ("nobias-nocap", "bias-cap3")
] + ["R9-V97-B32-float64-bias-nocap", "public-kernel-triton", "compiled-dynamic-rows"]
DTYPES = {"torch.float32": torch.float32, "torch.float64": torch.float64}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.full
@pytest.mark.parametrize("case", EXPECTED)
def test_triton_kernel_matches_torch_op_under_interpreter(interpreted, case):
    assert case in interpreted, f"case {case} did not run; ran: {sorted(interpreted)}"
    res = interpreted[case]
    assert res["lp_dtype"] == res["dtype"]  # log-probs in at least float32, like the torch op
    atol = TOLERANCES[DTYPES[res["dtype"]]]
    bad = {k: v for k, v in res["errors"].items() if not v <= atol}
    assert not bad, f"{case}: max errors above {atol:g}: {bad}"
    if "cap3" in case and "bias" in case:
        assert "grad bias" in res["errors"]


@pytest.mark.full
def test_triton_op_registration_passes_opcheck(interpreted):
    assert interpreted["opcheck"] == {"ok": True}


def test_triton_kernel_asked_for_on_cpu_without_interpreter_raises():
    hidden, weight = torch.randn(3, 4), torch.randn(7, 4)
    slot, target = torch.tensor([0, 2]), torch.tensor([1, 6])
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        fused_target_logprobs(hidden, weight, None, slot, target, kernel="triton")


def test_unknown_kernel_lists_the_choices():
    hidden, weight = torch.randn(3, 4), torch.randn(7, 4)
    with pytest.raises(ValueError, match="valid kernels: torch, triton"):
        fused_target_logprobs(hidden, weight, None, torch.tensor([0]), torch.tensor([1]), kernel="cuda")


def test_default_kernel_is_triton_on_cuda_only():
    assert KERNELS == ("torch", "triton")
    assert default_kernel(torch.device("cuda")) == "triton"
    assert default_kernel(torch.device("cpu")) == "torch"
