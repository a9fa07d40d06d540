"""The project's own CUDA Viterbi tile encoder (issue 39; docs/encoder.md, "Our tile kernel").

`trellis_encode.cu` is compiled with torch.utils.cpp_extension on first use and cached by torch in its
extensions folder ($TORCH_EXTENSIONS_DIR, else torch's default under the user's cache); the module name
carries a hash of the source, so an edited kernel is a new build, never a stale one. It encodes 16x16 tiles
at integer K 1-6 with the 3INST, mcg or mul1 codebook and at the half rates 1.5, 2.5 and 3.5 (mul1 only, as
in exllamav3), and returns the same codes as exllamav3 1.6.5's `quantize_tiles` and `quantize_tiles_frac`
(checked by tests/gpu/test_encoder_kernel.py).

`load(say)` compiles or loads it up front: the quantize stage calls it before its first unit, so that a
first compile is announced and timed rather than hidden in a unit. `quantize_tiles(tiles, quant_args)` takes
exllamav3's arguments and returns its outputs (reconstructed tiles, int16 states); where our kernel cannot
run (no CUDA, no compiler, its source missing from the installed package, a failed compile, K 7 or 8, rows of
160) it says why in one line, once per reason, and calls exllamav3's own function; a compile is tried once a
process. `in_exllamav3()` puts it in place of exllamav3's two tile searches for the length of a `with` block,
so exllamav3's whole conversion (scale search, LDLQ, packing) runs unchanged around ours: one GPU's calls go
through that module's globals, `quantize_tiles` at integer K and `quantize_tiles_frac` at half rates.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from quantizer.caches import on_reset, process_cache
from quantizer.exl3 import HALF_RATES, INTEGER_RATES, Codebook

SOURCE = Path(__file__).with_name("trellis_encode.cu")
EXLLAMAV3_ENCODER = "exllamav3.modules.quant.exl3_lib.quantize"  # the module whose quantize_tiles we stand in for
MAX_INTEGER_K = 6  # K 7 and 8 stay with exllamav3's encoder
KS = (*(k for k in INTEGER_RATES if k <= MAX_INTEGER_K), *HALF_RATES)  # the half rates mul1 only, as in exllamav3
TILE = 256
# The kernel's codebook argument (its switch in trellis_encode.cu), by codebook name.
CODEBOOKS = {Codebook.INST3.value: 0, Codebook.MCG.value: 1, Codebook.MUL1.value: 2}

_said: set[str] = set()


class KernelUnavailable(RuntimeError):
    """Our kernel cannot be built or run here; the message says why in one line."""


def _module_name(source: Path) -> str:
    """The build's name: a hash of the source's text (KernelUnavailable, in one line, where the source is missing)."""
    try:
        text = source.read_bytes()
    except FileNotFoundError:
        raise KernelUnavailable(f"the kernel source {source.name} is missing from the installed package "
                                f"(no {source})") from None
    return "quantizer_trellis_" + hashlib.sha256(text).hexdigest()[:12]


@process_cache(maxsize=1)
def _built() -> tuple[object | None, str | None]:
    """(the compiled extension, None), or (None, why it cannot be built here): tried once a process, so a
    failed compile is not run again for every tile search of the stage."""
    try:
        return build(SOURCE), None
    except KernelUnavailable as e:
        return None, str(e)


def _extension():
    """The compiled extension (built on the first call of a process, then loaded from torch's cache)."""
    module, why = _built()
    if module is None:
        raise KernelUnavailable(why)
    return module


def build(source: Path):
    """The extension compiled from `source`, this kernel or another version of it (bench/encoder_kernel.py
    times an earlier commit's beside it); named by a hash of the text, so each version is its own build."""
    if not torch.cuda.is_available():
        raise KernelUnavailable("no CUDA device")
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise KernelUnavailable("no CUDA toolkit (nvcc) to build it")
    name = _module_name(source)  # a missing source is its own one-line reason, not a failed build
    try:
        return cpp_extension.load(name=name, sources=[str(source)], extra_cuda_cflags=["-O3"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure becomes the one-line reason for the fallback
        kept = kept_build(source)  # a damaged build torch found up to date (a killed link, a full disk)
        fix = f" (delete {kept} to compile it again)" if kept else ""
        raise KernelUnavailable(f"building {source.name} failed: {type(e).__name__}: {_build_error(str(e))}{fix}") from e


def _build_error(text: str) -> str:
    """The compiler's first error line of a failed build's output (ninja's first line says only which command
    failed), else that first line."""
    lines = [line.strip() for line in text.strip().splitlines()]
    return next((line for line in lines if "error" in line.lower() and "Error building extension" not in line),
                lines[0] if lines else "")


def unavailable_reason() -> str | None:
    """Why our kernel cannot run in this process (None: it can)."""
    return _built()[1]


def _compiler() -> bool:
    """Whether torch found a CUDA toolkit to compile with (build() says so in one line when not)."""
    from torch.utils import cpp_extension

    return cpp_extension.CUDA_HOME is not None


def build_root() -> Path:
    """Where torch keeps compiled extensions: $TORCH_EXTENSIONS_DIR, else its per-user default."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def kept_build(source: Path | None = None) -> Path | None:
    """The folder where torch's extension cache holds a compiled `source` already (loading it then takes a
    second), or None. torch builds into <root>/<name> under $TORCH_EXTENSIONS_DIR and into
    <root>/<python>_<cuda>/<name> under its default root; both are looked at. `source`: this kernel's by default."""
    root, name = build_root(), _module_name(source or SOURCE)
    return next((d for d in (root / name, *root.glob(f"*/{name}")) if any(d.glob(f"{name}*.so"))), None)


def is_built(source: Path | None = None) -> bool:
    """Whether a compiled `source` (this kernel's by default) is kept (a load, not a compile, comes next)."""
    return kept_build(source) is not None


def load(say: Callable[[str], None]) -> bool:
    """Compile or load our kernel now, before a stage's progress bar starts: a first compile takes minutes
    (docs/measurements.md) and would otherwise sit unexplained inside the first unit. `say` gets a line
    before a compile and one with its time after; where the kernel cannot run, the fallback's one line is
    printed once. True when our kernel is ready."""
    try:
        compiling = torch.cuda.is_available() and _compiler() and not is_built(SOURCE)
    except KernelUnavailable as e:  # its source is missing: nothing to compile or load
        _say_once(str(e))
        return False
    if compiling:
        say(f"compiling our encoder kernel ({SOURCE.name}), once for this source on this machine; torch keeps "
            f"it in {build_root()}")
    start = time.monotonic()
    if (why := unavailable_reason()) is not None:
        _say_once(why)
        return False
    if compiling:
        say(f"our encoder kernel compiled in {time.monotonic() - start:.0f} s")
    return True


def codebook_index(quant_args: dict) -> int:
    """exllamav3's codebook switch from its quant_args: mul1, else mcg, else 3INST."""
    return CODEBOOKS["mul1"] if quant_args.get("mul1") else CODEBOOKS["mcg"] if quant_args.get("mcg") else CODEBOOKS["3inst"]


def encode_tiles(tiles: torch.Tensor, K: float, codebook: int, *, max_blocks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Our kernel on (N, 256) float32 CUDA tiles: (reconstructed values float32, states int16), each (N, 256).
    `max_blocks` > 0 caps the blocks per launch (each block's history scratch: docs/encoder.md, "Our tile
    kernel"; 8 MiB at K 3)."""
    if K not in KS:
        raise ValueError(f"encode_tiles: K {K!r}; our kernel does K 1-6, 1.5, 2.5 and 3.5")
    if codebook not in CODEBOOKS.values():
        raise ValueError(f"encode_tiles: codebook {codebook!r}; 0 (3INST), 1 (mcg) or 2 (mul1)")
    if K in HALF_RATES and codebook != CODEBOOKS["mul1"]:
        raise ValueError(f"encode_tiles: K {K:g} needs the mul1 codebook (2), got {codebook}")
    if tiles.dim() != 2 or tiles.shape[1] != TILE:
        raise ValueError(f"encode_tiles: tiles must be (N, {TILE}), got {tuple(tiles.shape)}")
    if not torch.isfinite(tiles).all():
        raise ValueError("tiles contain NaN or inf")
    tiles = tiles.to(torch.float32).contiguous()
    ka = int(K)
    values, states = _extension().encode_tiles(tiles, ka, ka + (K != ka), int(codebook), int(max_blocks))
    return values, states


@on_reset
def _forget_said() -> None:
    """A reset process says each fallback reason again (the GPU suite resets around every test)."""
    _said.clear()


def _say_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        print(f"encoder kernel: {reason}; using exllamav3's quantize_tiles", file=sys.stderr)


def fallback_reason(tiles: torch.Tensor, quant_args: dict) -> str | None:
    """Why these tiles go to exllamav3's encoder instead of ours (None: ours runs)."""
    K = quant_args["K"]
    if K not in KS:
        return f"K {K:g} is outside our kernel's K 1-6, 1.5, 2.5 and 3.5"
    if K in HALF_RATES and codebook_index(quant_args) != CODEBOOKS["mul1"]:
        return f"K {K:g} needs the mul1 codebook"
    if tiles.dim() != 2 or tiles.shape[1] != TILE:
        return f"tiles of length {tiles.shape[-1]} (our kernel does {TILE})"
    if tiles.device.type != "cuda":
        return "tiles are not on a CUDA device"
    return unavailable_reason()


def quantize_tiles(tiles: torch.Tensor, quant_args: dict, theirs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """exllamav3's `quantize_tiles(tiles, quant_args)` with our kernel where it can run (see the module
    docstring); the outputs have exllamav3's dtypes and shapes. `theirs`: exllamav3's function to fall back
    on (default: its module's current one)."""
    if (why := fallback_reason(tiles, quant_args)) is None:
        with torch.cuda.device(tiles.device):
            return encode_tiles(tiles, quant_args["K"], codebook_index(quant_args))
    _say_once(why)
    return (theirs or importlib.import_module(EXLLAMAV3_ENCODER).quantize_tiles)(tiles, quant_args)


@contextlib.contextmanager
def in_exllamav3():
    """Within the block exllamav3's conversion calls our `quantize_tiles` for its tile searches, at integer K
    (its `quantize_tiles`) and at half rates (its `quantize_tiles_frac`, which its batch code calls by name)."""
    module = importlib.import_module(EXLLAMAV3_ENCODER)
    originals = {name: getattr(module, name) for name in ("quantize_tiles", "quantize_tiles_frac")}
    for name, original in originals.items():
        setattr(module, name, functools.partial(quantize_tiles, theirs=original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)
