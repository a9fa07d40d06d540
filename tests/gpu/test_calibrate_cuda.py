"""The calibrate stage on CUDA (run on the GPU machine: `python -m pytest tests/gpu/test_calibrate_cuda.py -q`):
bf16 on the GPU gives every target a usable Hessian, routing counts that add up, and Hessians that
track the float32 CPU run where routing cannot flip (the first layer's attention input)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantizer.calibrate import CalibrationSettings, HessianStore, calibrate
from quantizer.checkpoint.source import Checkpoint
from quantizer.codec.ldlq import finalize_hessian
from quantizer.model.targets import DRAFT, targets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("all_experts", [True, False])
def test_cuda_calibration_matches_cpu_where_it_can(tiny_v41, tmp_path, all_experts):
    ck = Checkpoint.open(tiny_v41)
    rows = torch.from_numpy(np.random.default_rng(0).integers(3, 4096, size=(4, 64)))
    runs = {}
    for device in ("cpu", "cuda"):
        settings = CalibrationSettings(device=device, all_experts=all_experts, row_chunk=2)
        result = calibrate(ck, rows, tmp_path / device, settings, progress=False)
        runs[device] = (result, HessianStore(tmp_path / device, ck))
    result, store = runs["cuda"]
    k = ck.config.experts_per_token
    assert all(sum(layer.expert_tokens) == rows.numel() * k for layer in result.summary.layers)
    for t in targets(ck.config):
        if t.group == DRAFT:
            continue
        h, count = store.hessian(t.key)
        damped = finalize_hessian(h, count)
        assert damped is not None and torch.linalg.cholesky_ex(damped)[1] == 0, t.key
    cpu = runs["cpu"][1].hessian("layers.0.attn.wq_a")
    gpu = store.hessian("layers.0.attn.wq_a")
    rel = (gpu[0] - cpu[0]).norm() / cpu[0].norm()
    assert gpu[1] == cpu[1] and rel < 2e-2
