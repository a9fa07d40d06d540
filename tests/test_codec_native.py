"""The compiled trellis encoder: the same states as the torch search bit for bit, a cached per-machine build,
and a clean fallback to torch when it cannot be built."""

import warnings

import pytest
import torch

from quantizer.codec import encode_tiles, native
from quantizer.codec.viterbi import _EXACT_SEAM_WINDOW, FAST_SEAM_WINDOW, _encode_torch
from quantizer.exl3 import Codebook

CASES = [("mul1", k) for k in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)] + [("mcg", 2), ("3inst", 4), ("mcg", 8)]


@pytest.fixture(scope="module")
def kernel():
    k = native.kernel()
    assert k is not None, "the C++ encoder did not build (needs a C++ compiler); see the warning above"
    return k


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """kernel() with an empty cache under tmp_path; the real cached kernel is restored afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.kernel.cache_clear()
    yield
    native.kernel.cache_clear()


@pytest.mark.parametrize("codebook,K", CASES)
def test_kernel_and_torch_search_agree_bit_for_bit(kernel, codebook, K):
    tiles = torch.randn(3, 256, generator=torch.Generator().manual_seed(int(4 * K)))
    tiles[2] *= 3.0  # saturating values: ties and the codebook's edges
    for mode, seam in (("exact", _EXACT_SEAM_WINDOW), ("fast", FAST_SEAM_WINDOW)):
        ours = encode_tiles(tiles, K, codebook, mode)
        assert torch.equal(ours, _encode_torch(tiles, K, Codebook(codebook), seam)), mode


def test_kernel_spreads_tiles_over_threads_without_changing_them(kernel):
    tiles = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    values = torch.randn(65536, generator=torch.Generator().manual_seed(4))
    bits = (2,) * 256
    one = kernel.encode_tiles(tiles, values, bits, 16, 1)
    assert torch.equal(kernel.encode_tiles(tiles, values, bits, 16, 4), one)
    assert torch.equal(kernel.encode_tiles(tiles[3:4], values, bits, 16, 4), one[3:4])
    with pytest.raises(ValueError, match="invalid"):
        kernel.encode_tiles(tiles, values, (2, 5) * 128, 16, 1)


def test_build_is_cached_per_source_and_cpu(fresh_kernel, tmp_path):
    assert native.cache_dir().is_relative_to(tmp_path / "quantizer" / "native")
    first = native.kernel()
    assert first is not None and (native.cache_dir() / "exl3_viterbi.so").is_file()
    native.kernel.cache_clear()
    mtime = (native.cache_dir() / "exl3_viterbi.so").stat().st_mtime_ns
    assert native.kernel() is not None
    assert (native.cache_dir() / "exl3_viterbi.so").stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_failed_build_falls_back_to_torch_with_one_warning(fresh_kernel, monkeypatch, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    tiles = torch.randn(1, 256, generator=torch.Generator().manual_seed(5))
    with pytest.warns(RuntimeWarning, match="C\\+\\+ trellis encoder unavailable .*pure-torch") as caught:
        states = encode_tiles(tiles, 2, "mul1", "fast")
        encode_tiles(tiles, 2, "mul1", "fast")
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert torch.equal(states, _encode_torch(tiles, 2, Codebook.MUL1, FAST_SEAM_WINDOW))


def test_turned_off_means_torch_without_a_warning(fresh_kernel, monkeypatch):
    monkeypatch.setenv("QUANTIZER_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.kernel() is None


def test_missing_source_falls_back_to_torch_with_one_warning_naming_it(fresh_kernel, monkeypatch, tmp_path):
    """A package installed without viterbi_kernel.cpp (pyproject.toml's package-data; tests/test_wheel.py): the
    one warning of a failed build, naming the missing source, then the torch encoder."""
    missing = tmp_path / "viterbi_kernel.cpp"
    monkeypatch.setattr(native, "SOURCE", missing)
    tiles = torch.randn(1, 256, generator=torch.Generator().manual_seed(6))
    with pytest.warns(RuntimeWarning) as caught:
        states = encode_tiles(tiles, 2, "mul1", "fast")
        encode_tiles(tiles, 2, "mul1", "fast")
    (warned,) = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert warned.startswith("EXL3 C++ trellis encoder unavailable (the kernel source viterbi_kernel.cpp is missing "
                             "from the installed package: no ")
    assert warned.endswith("); using the pure-torch encoder, several times slower on a CPU") and "\n" not in warned
    assert torch.equal(states, _encode_torch(tiles, 2, Codebook.MUL1, FAST_SEAM_WINDOW))
