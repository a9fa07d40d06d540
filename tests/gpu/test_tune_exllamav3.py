"""`build --tune` and `build --tune --tune-e2e` packs of the tiny V4 checkpoint load in stock exllamav3 1.6.5
and decode as we do; block-wise tuning on CUDA does what it does on the CPU.

Run on the GPU machine: `source .device-cache/setup.sh && python -m pytest tests/gpu/test_tune_exllamav3.py -q`.
Both tune stages change only the EXL3 linears' suh/svh (tests/test_tune.py checks that on the CPU); here
exllamav3 loads the tuned pack, every EXL3 linear checked holds the trellis and the tuned scales the
pack stores, reconstructs our decode bit for bit in the rotated basis and matches our original-basis
weight to fp16 rounding, and its logits agree with our forward on the same pack as closely as the
two engines agree on the native checkpoint, on the tokens free of routing and indexer near-ties
(test_pack_exllamav3.py says why).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

# tests/gpu is on sys.path (pytest prepend import mode)
from test_pack_exllamav3 import _load, _stored, assert_engines_agree, check_linears_decode_as_ours

from quantizer.orchestrate.stages import QUANTIZE_DIR, plan_files
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.contract.plan import Plan
from quantizer.pack.manifest import Manifest
from quantizer.tune import stage
from quantizer.tune.settings import TuneSettings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and exllamav3")


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    path = tmp_path_factory.mktemp("ids") / "ids.npy"
    # 16 rows over the first 200 token ids, as tests/test_tune.py draws them: rows that share their tokens are
    # rows whose held-out error tuning can lower on this random model (over 4000 ids, 8 rows, no block's
    # held-out error fell at 2.5 bpw with the default gate2 Hessians)
    np.save(path, np.random.default_rng(0).integers(3, 200, size=(16, 64)))
    return path


@pytest.fixture(scope="module")
def tuned(tiny_v4, ids, tmp_path_factory):
    root = tmp_path_factory.mktemp("tuned")
    assert main(["build", str(tiny_v4), "--bpw", "2.5", "--method", "uniform", "--loader", "exllamav3", "--tokens",
                 str(ids), "--device", "cpu", "--tune", "--tune-steps", "20", "--out", str(root / "pack")]) == 0
    assert Manifest.load(root / "pack").settings["tuning"]["tune_rows"] > 0
    return root / "pack"


@pytest.fixture(scope="module")
def tuned_e2e(tiny_v4, ids, tmp_path_factory):
    """Block-wise, then end to end on the GPU (the build's device), the head's scales among those tuned."""
    root = tmp_path_factory.mktemp("tuned-e2e")
    assert main(["build", str(tiny_v4), "--bpw", "2.5", "--method", "uniform", "--loader", "exllamav3", "--tokens",
                 str(ids), "--device", "cuda", "--tune", "--tune-steps", "5", "--tune-e2e",
                 "--tune-e2e-steps", "20", "--out", str(root / "pack")]) == 0
    e2e = Manifest.load(root / "pack").settings["end_to_end"]
    assert e2e["heldout_kl_after"] <= e2e["heldout_kl_before"] and e2e["steps_run"] > 0
    assert "head.trellis" in Checkpoint.open(root / "pack").tensors  # the head is EXL3 and tuned end to end
    return root / "pack"


@pytest.mark.parametrize("pack", ["tuned", "tuned_e2e"])
def test_exllamav3_loads_a_tuned_pack_and_decodes_as_we_do(pack, request, tiny_v4, monkeypatch):
    tuned = request.getfixturevalue(pack)
    keys = sorted(n[: -len(".trellis")] for n in Checkpoint.open(tuned).tensors if n.endswith(".trellis"))
    model = _load(tuned)
    checked = keys[:: max(1, len(keys) // 24)] + (["head"] if "head" in keys else [])
    check_linears_decode_as_ours(model, tuned, checked)  # the trellis, and the decode with the tuned scales
    for key in checked:  # exllamav3 holds the tuned suh/svh the pack stores, not the encoder's
        q, inner = _stored(tuned, key), model.find_module(key).inner
        assert torch.equal(inner.suh.cpu(), q.suh) and torch.equal(inner.svh.cpu(), q.svh), key
    model.unload()
    assert_engines_agree(tuned, tiny_v4, monkeypatch, 0.5)


def test_block_tuning_on_cuda_lowers_each_blocks_error_as_on_the_cpu(tuned_e2e, tiny_v4, ids, tmp_path):
    """The block-wise stage on the build's device: the same codes, rows and settings tuned on CUDA and on
    the CPU keep each block's held-out error at or below the stored scales' by the same ratio."""
    work = tuned_e2e.with_name(tuned_e2e.name + ".work")
    ck, plan = Checkpoint.open(tiny_v4), Plan.load(plan_files(work, tuned_e2e)[0])
    job = {k: v for k, v in Manifest.load(tuned_e2e).settings.items() if k not in ("tuning", "end_to_end")}
    rows = torch.from_numpy(np.load(ids))
    settings = TuneSettings(steps=5, eval_every=1)
    ratios = {}
    for device in ("cuda", "cpu"):
        r = stage.tune(ck, plan, work / QUANTIZE_DIR, tmp_path / device, rows, settings, job, say=lambda line: None,
                       device=device)
        assert r.tuned == r.blocks > 0
        ratios[device] = {b: after / before for b, (before, after) in r.errors.items()}
    assert all(v <= 1.0 for v in ratios["cuda"].values()) and min(ratios["cuda"].values()) < 0.99
    assert ratios["cuda"].keys() == ratios["cpu"].keys()
    assert all(abs(ratios["cuda"][b] - ratios["cpu"][b]) < 0.02 for b in ratios["cpu"]), ratios
