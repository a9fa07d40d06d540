"""A `build --tune` pack of the tiny V4 checkpoint loads in stock exllamav3 1.6.5 and decodes as we do.

Run on the GPU machine: `source .device-cache/setup.sh && python -m pytest tests/gpu/test_tune_exllamav3.py -q`.
The tune stage changes only the EXL3 linears' suh/svh (tests/test_tune.py checks that on the CPU); here
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

from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.pack.manifest import Manifest

# tests/gpu is on sys.path (pytest prepend import mode)
from test_pack_exllamav3 import _load, _stored, assert_engines_agree, check_linears_decode_as_ours

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and exllamav3")


@pytest.fixture(scope="module")
def tuned(tiny_v4, tmp_path_factory):
    root = tmp_path_factory.mktemp("tuned")
    ids = root / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(3, 4000, size=(8, 64)))
    assert main(["build", str(tiny_v4), "--bpw", "2.5", "--method", "uniform", "--loader", "exllamav3", "--tokens",
                 str(ids), "--tune", "--tune-steps", "20", "--out", str(root / "pack")]) == 0
    assert Manifest.load(root / "pack").settings["tuning"]["tune_rows"] > 0
    return root / "pack"


def test_exllamav3_loads_a_tuned_pack_and_decodes_as_we_do(tuned, tiny_v4, monkeypatch):
    keys = sorted(n[: -len(".trellis")] for n in Checkpoint.open(tuned).tensors if n.endswith(".trellis"))
    model = _load(tuned)
    checked = keys[:: max(1, len(keys) // 24)]
    check_linears_decode_as_ours(model, tuned, checked)  # the trellis, and the decode with the tuned scales
    for key in checked:  # exllamav3 holds the tuned suh/svh the pack stores, not the encoder's
        q, inner = _stored(tuned, key), model.find_module(key).inner
        assert torch.equal(inner.suh.cpu(), q.suh) and torch.equal(inner.svh.cpu(), q.svh), key
    model.unload()
    assert_engines_agree(tuned, tiny_v4, monkeypatch, 0.5)
