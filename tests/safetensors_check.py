"""The safetensors package as the cross-check of our own reader and writer
(quantizer/checkpoint/safetensors_file.py): every shard a test builds, opened by both, must hold the
same tensors (names, dtypes, shapes, bytes) and the same metadata. Tests that write checkpoints or
packs call `assert_safetensors_agree` on what they wrote; it reads each file once (test packs are a
few MB)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from quantizer.checkpoint.safetensors_file import read_bytes, read_header


def assert_safetensors_agree(*paths: Path) -> int:
    """Every `.safetensors` file in `paths` (files or directories) read by safetensors and by our reader;
    AssertionError naming the file and tensor on the first difference. Returns how many files were checked."""
    files = sorted(f for p in map(Path, paths) for f in ([p] if p.is_file() else p.glob("*.safetensors")))
    assert files, f"no .safetensors file in {paths}"
    for file in files:
        ours = read_header(file)
        with safe_open(str(file), framework="pt") as ref:
            assert set(ref.keys()) == set(ours.tensors), f"{file}: tensor names differ"
            assert (ref.metadata() or {}) == ours.metadata, f"{file}: metadata differs"
            for name, entry in ours.tensors.items():
                part = ref.get_slice(name)
                assert (part.get_dtype(), tuple(part.get_shape())) == (entry.dtype, entry.shape), f"{file}: {name}"
                theirs = ref.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                assert theirs == bytes(read_bytes(entry)), f"{file}: {name}: bytes differ"
    return len(files)
