"""What an engine that serves weights from the mapped file keeps in GPU memory, and what it leaves in the
page cache (docs/gb10-memory.md, one Spark: native ExLlamaV3's V4.1 loader).

With EXL3_ATS_MMAP=1 the loader hands a tensor to the GPU straight from a shared read-only mapping of its
shard when the tensor is at least `min_bytes`, needs no conversion and starts on its grid (16 bytes for an
int16 trellis, its item size otherwise); everything else is copied. A source-form FP8 or FP4 linear is
dequantized to FP16 at load (2 bytes a weight: twice an FP8 tensor's bytes, four times packed FP4's),
unless the lazy mode (EXL3_FP8_LAZY=1) keeps it compact; BF16 becomes FP16. Of the tensors that could be
served from the mapping, those whose name matches the copy pattern (EXL3_ATS_COPY) are copied too. Copied
bytes are GPU memory the kernel cannot reclaim; mapped bytes are page cache, read from NVMe again when the
kernel has dropped them.
"""

from __future__ import annotations

import re
from collections import defaultdict
from fnmatch import fnmatchcase

from quantizer.checkpoint.safetensors_file import ELEMENT_BYTES
from quantizer.errors import UserError
from quantizer.fit.hardware import MappedServing
from quantizer.fit.stored import StoredTensor
from quantizer.model.tensor_classes import ENGRAM_TABLE, VISION


def copy_rule(pattern: str) -> re.Pattern:
    """The copy pattern as the loader applies it; a malformed one is a UserError naming it."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise UserError(f"copy pattern {pattern!r} is not a regular expression ({e})") from None


def split_mapped(stored: list[StoredTensor], serving: MappedServing, pattern: str, fp8_lazy: bool = False
                 ) -> tuple[list[StoredTensor], list[StoredTensor]]:
    """(tensors copied into GPU memory, each with the bytes it takes there; tensors served from the mapped
    file). Engram tables pass through as copied (the fit's Engram mode places them); a vision tower the
    engine does not build is neither."""
    copy = copy_rule(pattern)
    scales = {t.name for t in stored if t.name.endswith(".scale") and len(t.shape) == 2}
    copied: list[StoredTensor] = []
    mapped: list[StoredTensor] = []
    for t in stored:
        if t.cls == VISION and not serving.loads_vision:
            continue
        source_linear = t.name.endswith((".weight", ".scale")) and t.name.rsplit(".", 1)[0] + ".scale" in scales
        if source_linear and not fp8_lazy:
            if t.name.endswith(".weight"):  # dequantized to FP16; its scale grid is consumed
                weights = t.shape[0] * t.shape[1] * (2 if t.dtype == "I8" else 1)
                copied.append(t._replace(nbytes=2 * weights, dtype="F16"))
            continue
        if t.cls != ENGRAM_TABLE and _mappable(t, serving) and not copy.search(t.name):
            mapped.append(t)
        else:
            copied.append(t)
    return copied, mapped


def _mappable(t: StoredTensor, serving: MappedServing) -> bool:
    """Large enough, no conversion on load (BF16 and F32 are converted, but where the module reads them as
    stored: an Embedding's BF16, a hyper-connection's F32 mixer), and on its grid. A tensor of a plan (no file
    offset yet) is laid out on a 64-byte grid by the packs of the profiles this engine loads."""
    if t.nbytes < serving.min_bytes:
        return False
    if t.dtype in ("BF16", "F32") and not any(fnmatchcase(t.name, p) for p in serving.as_stored):
        return False
    grid = serving.trellis_align if t.dtype in ("I16", "U16") else ELEMENT_BYTES[t.dtype]
    return t.offset is None or t.offset % grid == 0


def bytes_by_class(tensors: list[StoredTensor]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for t in tensors:
        out[t.cls] += t.nbytes
    return dict(sorted(out.items()))
