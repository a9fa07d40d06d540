"""The tile kernel's loader says in one line why it falls back to exllamav3, and refuses bad input."""

from __future__ import annotations

import pytest
import torch

from quantizer.quantize import kernel


def test_fallback_reasons_one_line_each():
    tiles = torch.zeros(4, 256)
    assert kernel.fallback_reason(tiles, {"K": 2.5, "mul1": True}) == "K 2.5 is half-integer (our kernel does integer K only)"
    assert kernel.fallback_reason(tiles, {"K": 7}) == "K 7 is outside our kernel's K 1-6"
    assert kernel.fallback_reason(torch.zeros(4, 160), {"K": 3, "mul1": True}) == "tiles of length 160 (our kernel does 256)"
    if not torch.cuda.is_available():
        assert kernel.fallback_reason(tiles, {"K": 3}) == "tiles are not on a CUDA device"
        assert kernel.unavailable_reason() == "no CUDA device"


def test_said_once_per_reason(capsys, monkeypatch):
    monkeypatch.setattr(kernel, "_said", set())
    for _ in range(3):
        kernel._say_once("K 2.5 is half-integer")
    kernel._say_once("no CUDA device")
    err = capsys.readouterr().err.splitlines()
    assert err == ["encoder kernel: K 2.5 is half-integer; using exllamav3's quantize_tiles",
                   "encoder kernel: no CUDA device; using exllamav3's quantize_tiles"]


def test_codebook_switch_follows_exllamav3():
    assert kernel.codebook_index({"mul1": True, "mcg": True}) == 2
    assert kernel.codebook_index({"mcg": True}) == 1
    assert kernel.codebook_index({}) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_refused_before_any_build(bad):
    tiles = torch.zeros(2, 256)
    tiles[0, 3] = bad
    with pytest.raises(ValueError, match="^tiles contain NaN or inf$"):
        kernel.encode_tiles(tiles, 2, 2)


def test_source_hash_names_the_build():
    name = kernel._module_name()
    assert name.startswith("quantizer_trellis_") and len(name) == len("quantizer_trellis_") + 12
