"""The decoder against exllamav3's own CUDA reconstruction, recorded on the GPU machine.

Recorded on the GPU machine by tests/gpu/test_codec_exllamav3.py with RECORD_FIXTURES=DIR, then copied
to tests/fixtures/codec/: per case, exllamav3's tensors for a 128 (in) x 256 (out) weight and its CUDA
`reconstruct` output.
"""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from quantizer.codec import EXL3Linear, decode_rotated

FIXTURES = Path(__file__).parent / "fixtures" / "codec"
if not FIXTURES.is_dir():
    pytest.skip("tests/fixtures/codec/ not recorded yet (run tests/gpu/test_codec_exllamav3.py with "
                "RECORD_FIXTURES=tests/fixtures/codec on the GPU machine)", allow_module_level=True)

PATHS = sorted(FIXTURES.glob("*.safetensors"))
RATES = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8)


def test_every_case_is_recorded():
    expected = {f"{cb}_k{k}" for cb in ("mul1", "mcg", "3inst") for k in RATES if cb == "mul1" or k == int(k)}
    assert {p.stem for p in PATHS} == expected


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_decode_is_bit_exact_with_exllamav3(path):
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    q = EXL3Linear.from_tensors(tensors, "weight")
    assert q.codebook.value == meta["codebook"] and float(q.K) == float(meta["K"])
    ref = tensors["reconstructed"]
    ours = decode_rotated(q.trellis, q.K, q.codebook)
    assert ours.shape == ref.shape and torch.equal(ours.view(torch.int16), ref.view(torch.int16))
