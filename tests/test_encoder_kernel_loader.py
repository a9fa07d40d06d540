"""The tile kernel's loader says in one line why it falls back to exllamav3, and refuses bad input; the
quantize stage's --encoder picks it on cuda."""

from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path

import pytest
import torch

from quantizer.codec import kernel
from quantizer.errors import UserError
from quantizer.quantize.settings import QuantizeSettings


def test_fallback_reasons_one_line_each():
    tiles = torch.zeros(4, 256)
    assert kernel.fallback_reason(tiles, {"K": 7}) == "K 7 is outside our kernel's K 1-6, 1.5, 2.5 and 3.5"
    assert kernel.fallback_reason(tiles, {"K": 3.25, "mul1": True}).startswith("K 3.25 is outside")
    assert kernel.fallback_reason(tiles, {"K": 2.5, "mcg": True}) == "K 2.5 needs the mul1 codebook"
    assert kernel.fallback_reason(torch.zeros(4, 160), {"K": 3, "mul1": True}) == "tiles of length 160 (our kernel does 256)"
    if not torch.cuda.is_available():
        assert kernel.fallback_reason(tiles, {"K": 3}) == "tiles are not on a CUDA device"
        assert kernel.unavailable_reason() == "no CUDA device"


def test_said_once_per_reason(capsys, monkeypatch):
    monkeypatch.setattr(kernel, "_said", set())
    for _ in range(3):
        kernel._say_once("K 7 is outside our kernel's K")
    kernel._say_once("no CUDA device")
    err = capsys.readouterr().err.splitlines()
    assert err == ["encoder kernel: K 7 is outside our kernel's K; using exllamav3's quantize_tiles",
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


def test_bad_rate_or_codebook_refused_before_any_build():
    tiles = torch.zeros(2, 256)
    with pytest.raises(ValueError, match="K 7; our kernel does K 1-6, 1.5, 2.5 and 3.5"):
        kernel.encode_tiles(tiles, 7, 2)
    with pytest.raises(ValueError, match="K 2.5 needs the mul1 codebook"):
        kernel.encode_tiles(tiles, 2.5, kernel.CODEBOOKS["mcg"])


def test_source_hash_names_the_build(tmp_path):
    """An edited kernel (or another commit's, as bench/encoder_kernel.py --also builds) is its own build."""
    name = kernel._module_name(kernel.SOURCE)
    assert name.startswith("quantizer_trellis_") and len(name) == len("quantizer_trellis_") + 12
    edited = tmp_path / "trellis_encode.cu"
    edited.write_text(kernel.SOURCE.read_text() + "\n// edited\n")
    assert kernel._module_name(edited) != name
    assert kernel._module_name(edited) == kernel._module_name(edited)


def test_in_exllamav3_routes_tile_searches_through_ours_and_restores_theirs(monkeypatch):
    """exllamav3's conversion looks its quantize_tiles (integer K) and quantize_tiles_frac (half rates) up in
    its module at each call: inside the block both names are ours (falling back to the matching one of theirs
    where ours cannot run), after it theirs again, on error too."""
    calls = []

    def theirs(tiles, quant_args):
        calls.append(("tiles", quant_args["K"]))
        return tiles, torch.zeros(tiles.shape, dtype=torch.int16)

    def theirs_frac(tiles, quant_args):
        calls.append(("frac", quant_args["K"]))
        return tiles, torch.zeros(tiles.shape, dtype=torch.int16)

    module = types.ModuleType(kernel.EXLLAMAV3_ENCODER)
    module.quantize_tiles, module.quantize_tiles_frac = theirs, theirs_frac
    monkeypatch.setitem(sys.modules, kernel.EXLLAMAV3_ENCODER, module)
    monkeypatch.setattr(kernel, "_said", set())
    with kernel.in_exllamav3():
        assert module.quantize_tiles is not theirs and module.quantize_tiles_frac is not theirs_frac
        module.quantize_tiles(torch.zeros(3, 160), {"K": 3, "mul1": True})  # rows of 160: theirs
        module.quantize_tiles_frac(torch.zeros(3, 256), {"K": 2.5, "mul1": True})  # on a CPU: theirs
    assert calls == [("tiles", 3), ("frac", 2.5)]
    assert module.quantize_tiles is theirs and module.quantize_tiles_frac is theirs_frac
    with pytest.raises(RuntimeError, match="boom"), kernel.in_exllamav3():
        raise RuntimeError("boom")
    assert module.quantize_tiles is theirs and module.quantize_tiles_frac is theirs_frac


def test_each_device_has_its_encoders_and_a_cuda_job_pins_exllamav3_codes():
    assert QuantizeSettings().encoder == "fast"
    assert QuantizeSettings(device="cuda").encoder == "ours"
    assert QuantizeSettings(device="cuda").record()["encoder"] == "exllamav3"  # same codes
    assert QuantizeSettings(device="cuda", encoder="exllamav3").record()["encoder"] == "exllamav3"  # so caches resume either way
    with pytest.raises(UserError, match=r"^--encoder fast is not an encoder of --device cuda; choose ours or exllamav3$"):
        QuantizeSettings(device="cuda", encoder="fast")
    with pytest.raises(UserError, match=r"^--encoder ours is not an encoder of --device cpu; choose fast or exact$"):
        QuantizeSettings(encoder="ours")


def test_a_failed_build_names_the_compilers_error():
    ninja = ("Error building extension 'quantizer_trellis_0': [1/2] /usr/local/cuda/bin/nvcc -c trellis_encode.cu\n"
             "FAILED: trellis_encode.cuda.o\n"
             "trellis_encode.cu(212): error: identifier \"__hmin\" is undefined\n1 error detected")
    assert kernel._build_error(ninja) == 'trellis_encode.cu(212): error: identifier "__hmin" is undefined'
    assert kernel._build_error("linker said no") == "linker said no"


@pytest.mark.parametrize("spec", ["ours={cu}", "prev={missing}", "not a name={cu}", "prev"])
def test_the_kernel_bench_refuses_an_earlier_version_it_cannot_build(tmp_path, capsys, spec):
    """bench/encoder_kernel.py --also NAME=PATH: a new identifier and an existing source, said before any GPU work."""
    cu = tmp_path / "trellis_encode.cu"
    cu.write_text(kernel.SOURCE.read_text())
    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "encoder_kernel.py"))
    with pytest.raises(SystemExit) as e:
        bench["main"](["--also", spec.format(cu=cu, missing=tmp_path / "none.cu")])
    assert e.value.code == 2 and "NAME=PATH with a new name and an existing .cu file" in capsys.readouterr().err


@pytest.mark.parametrize("ks", [["7"], ["2", "2.25"]])
def test_the_kernel_bench_refuses_a_k_our_kernel_does_not_encode(capsys, ks):
    """bench/encoder_kernel.py --ks: K 1-6 and the half rates 1.5, 2.5, 3.5, said before any GPU work."""
    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "encoder_kernel.py"))
    with pytest.raises(SystemExit) as e:
        bench["main"](["--ks", *ks])
    assert e.value.code == 2 and "our kernel does K 1-6, 1.5, 2.5 and 3.5" in capsys.readouterr().err
