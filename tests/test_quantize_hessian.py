"""With a Hessian provider the stage quantizes in the H metric (asked per stored key), job.json pins the
calibration, and the pack's quantization_config names its rows and columns."""

from __future__ import annotations

import json

import torch

from quantizer.calibrate.storage import HessianRecord
from quantizer.checkpoint.source import Checkpoint
from quantizer.codec import EXL3Linear, dequantize
from quantizer.contract.rules import make_plan
from quantizer.model.targets import targets
from quantizer.pack.writer import PackSettings, write_pack
from quantizer.quantize import QuantizeSettings, quantize
from quantizer.workdir import JOB_NAME

KEY = "layers.2.attn.wq_a"
HESSIANS = HessianRecord("sha256:test", rows=4, cols=64)


def test_a_calibrated_linear_is_quantized_in_the_hessian_metric(tiny_v41, tmp_path):
    ck = Checkpoint.open(tiny_v41)
    plan = make_plan(ck.config, {t.key: (4.0 if t.key == KEY else None) for t in targets(ck.config)})
    w = ck.weight(KEY + ".weight")
    x = torch.randn(HESSIANS.rows * HESSIANS.cols, w.shape[1], generator=torch.Generator().manual_seed(0))
    x[:, :8] *= 10  # a few loud input channels, as real activations have
    h = x.T @ x
    asked = []

    def hessian(key):
        asked.append(key)
        return h, x.shape[0]

    settings = QuantizeSettings(hessians=HESSIANS)
    result = quantize(ck, plan, tmp_path / "work", settings, hessian=hessian)
    assert asked == [KEY]
    assert json.loads((tmp_path / "work" / JOB_NAME).read_text())["settings"]["calibration"] == {
        "fingerprint": "sha256:test", "rows": 4, "cols": 64}

    write_pack(ck, plan, tmp_path / "work", tmp_path / "pack", PackSettings(job_settings=settings.record()))
    packed = Checkpoint.open(tmp_path / "pack")
    q = EXL3Linear.from_tensors({n: packed.raw(n) for n in packed.tensors if n.startswith(KEY + ".")}, KEY)
    e = dequantize(q) - w
    proxy = float(((e @ h) * e).sum() / ((w @ h) * w).sum())
    assert abs(result.proxy_err[KEY] - proxy) < 1e-3 * proxy
    assert json.loads((tmp_path / "pack" / "config.json").read_text())["quantization_config"]["calibration"] == {
        "rows": 4, "cols": 64}
