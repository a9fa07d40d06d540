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


@pytest.fixture
def fresh_build(monkeypatch):
    """The kernel's once-a-process build outcome forgotten before and after the test (caches.reset would
    clear every other cache too)."""
    forget = kernel._built.cache_clear
    forget()
    monkeypatch.setattr(kernel, "_said", set())
    yield
    forget()


def test_a_failed_compile_is_tried_once_a_process(monkeypatch, fresh_build, capsys):
    """A compile that fails (a compiler error) falls back to exllamav3 for the whole stage, without running
    the compiler again at every tile search."""
    tries = []

    def failing(source):
        tries.append(source)
        raise kernel.KernelUnavailable("building trellis_encode.cu failed: CalledProcessError: error: boom")

    monkeypatch.setattr(kernel, "build", failing)
    tiles = torch.zeros(2, 256)
    for _ in range(3):
        assert kernel.unavailable_reason() == "building trellis_encode.cu failed: CalledProcessError: error: boom"
    with pytest.raises(kernel.KernelUnavailable, match="error: boom"):
        kernel.encode_tiles(tiles, 3, kernel.CODEBOOKS["mul1"])
    assert tries == [kernel.SOURCE]


def test_a_build_is_found_under_either_of_torchs_layouts(tmp_path, monkeypatch):
    """$TORCH_EXTENSIONS_DIR/<name>/ and the default root's <python>_<cuda>/<name>/; another source's build
    or a folder without the library is not this kernel's build."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = kernel._module_name(kernel.SOURCE)
    assert kernel.build_root() == tmp_path and not kernel.is_built()
    (tmp_path / name).mkdir()
    (tmp_path / "quantizer_trellis_000000000000").mkdir()
    (tmp_path / "quantizer_trellis_000000000000" / "quantizer_trellis_000000000000.so").touch()
    assert not kernel.is_built()  # an interrupted compile leaves the folder without the library
    (tmp_path / name / f"{name}.so").touch()
    assert kernel.is_built()
    (tmp_path / name / f"{name}.so").unlink()
    (tmp_path / "py311_cu128" / name).mkdir(parents=True)
    (tmp_path / "py311_cu128" / name / f"{name}.so").touch()
    assert kernel.is_built()


def _loaded(monkeypatch, *, cuda=True, compiler=True, built=False, outcome=(object(), None)):
    said = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(kernel, "_compiler", lambda: compiler)
    monkeypatch.setattr(kernel, "is_built", lambda source=kernel.SOURCE: built)
    monkeypatch.setattr(kernel, "_built", lambda: outcome)
    return kernel.load(said.append), said


def test_load_says_before_a_compile_and_how_long_it_took(monkeypatch, fresh_build, capsys):
    ready, said = _loaded(monkeypatch)
    assert ready and len(said) == 2
    assert said[0].startswith("compiling our encoder kernel (trellis_encode.cu), once for this source on this machine")
    assert said[0].endswith(f"torch keeps it in {kernel.build_root()}")
    assert said[1].startswith("our encoder kernel compiled in ") and said[1].endswith(" s")
    assert capsys.readouterr().err == ""


def test_load_of_a_kept_build_says_nothing(monkeypatch, fresh_build, capsys):
    assert _loaded(monkeypatch, built=True) == (True, [])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("cuda", "compiler", "why"), [(False, True, "no CUDA device"),
                                                       (True, False, "no CUDA toolkit (nvcc) to build it")])
def test_load_where_nothing_can_compile_gives_the_fallbacks_line_alone(monkeypatch, fresh_build, capsys, cuda,
                                                                       compiler, why):
    assert _loaded(monkeypatch, cuda=cuda, compiler=compiler, outcome=(None, why)) == (False, [])
    assert capsys.readouterr().err == f"encoder kernel: {why}; using exllamav3's quantize_tiles\n"


def test_load_after_a_failed_compile_says_both(monkeypatch, fresh_build, capsys):
    ready, said = _loaded(monkeypatch, outcome=(None, "building trellis_encode.cu failed: error: boom"))
    assert not ready and len(said) == 1 and said[0].startswith("compiling our encoder kernel")
    assert capsys.readouterr().err == ("encoder kernel: building trellis_encode.cu failed: error: boom; "
                                       "using exllamav3's quantize_tiles\n")


def test_a_damaged_kept_build_names_the_folder_to_delete(tmp_path, monkeypatch):
    """A kept build that no longer loads (a killed link, a full disk): torch finds it up to date and the
    import fails; the one-line reason names the folder whose deletion makes the next run compile again."""
    from torch.utils import cpp_extension

    def load(**_):
        raise ImportError(f"{folder}/{name}.so: file too short")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = kernel._module_name(kernel.SOURCE)
    folder = tmp_path / name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(cpp_extension, "load", load)
    with pytest.raises(kernel.KernelUnavailable) as e:
        kernel.build(kernel.SOURCE)
    assert str(e.value) == f"building trellis_encode.cu failed: ImportError: {folder}/{name}.so: file too short"
    folder.mkdir()
    (folder / f"{name}.so").write_bytes(b"\x7fELF")
    with pytest.raises(kernel.KernelUnavailable) as e:
        kernel.build(kernel.SOURCE)
    assert str(e.value) == (f"building trellis_encode.cu failed: ImportError: {folder}/{name}.so: file too short "
                            f"(delete {folder} to compile it again)")


def test_a_missing_source_is_one_line_and_the_fallback(tmp_path, monkeypatch, fresh_build, capsys):
    """A package installed without trellis_encode.cu (pyproject.toml's package-data; tests/test_wheel.py): every
    path that reads the source raises KernelUnavailable saying so in one line (never FileNotFoundError), and
    load() says it once and falls back to exllamav3's encoder, compiling nothing."""
    from torch.utils import cpp_extension

    missing = tmp_path / "trellis_encode.cu"
    monkeypatch.setattr(kernel, "SOURCE", missing)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("a missing source was compiled"))
    why = f"the kernel source trellis_encode.cu is missing from the installed package (no {missing})"
    for reads in (lambda: kernel._module_name(missing), lambda: kernel.build(missing), kernel.kept_build,
                  kernel.is_built, lambda: kernel.encode_tiles(torch.zeros(2, 256), 3, kernel.CODEBOOKS["mul1"])):
        with pytest.raises(kernel.KernelUnavailable) as e:
            reads()
        assert str(e.value) == why
    said = []
    assert kernel.load(said.append) is False and said == []
    assert capsys.readouterr().err == f"encoder kernel: {why}; using exllamav3's quantize_tiles\n"
    assert kernel.unavailable_reason() == why  # what each tile search on a CUDA device falls back with
    kernel._say_once(kernel.unavailable_reason())
    assert capsys.readouterr().err == ""  # said once
