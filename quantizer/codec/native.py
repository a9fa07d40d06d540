"""The optional compiled trellis encoder (viterbi_kernel.cpp), built on first use and cached per machine.

It runs the same exact node-based search as viterbi.py, fused into one loop per position, and returns the
same states bit for bit. It needs a C++ compiler and ninja; when the build fails the encoder falls back to
pure torch (one warning). The build is tuned to this CPU (-march=native), so the cache key includes the
CPU's model and flags as well as the source, the flags and the torch version. QUANTIZER_NATIVE=0 turns
the kernel off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("viterbi_kernel.cpp")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17")
_NAME = "quantizer_exl3_viterbi"


def _cpu_fingerprint() -> str:
    """The CPU model and feature flags the build was tuned for (a shared home may span machines)."""
    info = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info = "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        pass
    return f"{platform.machine()}\n{platform.processor()}\n{info}"


def cache_dir() -> Path:
    """Where the build lives: $XDG_CACHE_HOME (or ~/.cache)/quantizer/native/<key of what the build depends on>."""
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), *_FLAGS, torch.__version__, _cpu_fingerprint()]).encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "quantizer" / "native" / key


@lru_cache(maxsize=None)
def kernel():
    """The compiled module (with encode_tiles), or None when it is turned off or cannot be built."""
    if os.environ.get("QUANTIZER_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        build = cache_dir()
        build.mkdir(parents=True, exist_ok=True)
        return load_inline(_NAME, cpp_sources=[SOURCE.read_text()], extra_cflags=list(_FLAGS),
                           build_directory=str(build), verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch encoder
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"EXL3 C++ trellis encoder unavailable ({reason[:200]}); using the pure-torch encoder, "
                      "about 10x slower on a CPU", RuntimeWarning, stacklevel=2)
        return None
