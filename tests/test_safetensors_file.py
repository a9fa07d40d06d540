"""Our safetensors writer and reader against the safetensors package, both ways, byte for byte, on every
dtype the pipeline stores; and the cross-check itself fails when our reader is wrong."""

from __future__ import annotations

import pytest
import torch
from safetensors_check import assert_safetensors_agree

from quantizer.checkpoint.safetensors_file import planned, read_header, read_tensor, write_safetensors


def test_our_writer_and_reader_agree_with_the_safetensors_package_on_every_dtype_we_use(tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 32, generator=g)
    tensors = [
        planned("fp8", values.to(torch.float8_e4m3fn)),
        planned("e8m0", torch.randint(0, 255, (4, 1), dtype=torch.uint8, generator=g), "F8_E8M0"),
        planned("fp4", torch.randint(-128, 127, (4, 16), dtype=torch.int8, generator=g)),
        planned("bf16", values.bfloat16()), planned("f32", values), planned("i16", (values * 100).short()),
        planned("empty", torch.empty(0, 8, dtype=torch.float16)), planned("scalar", torch.tensor(3.5)),
    ]
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, tensors, metadata={"format": "pt"}, align=64)
    assert assert_safetensors_agree(ours) == 1
    loaded = load_file(ours)
    assert torch.equal(loaded["fp8"].view(torch.uint8), values.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(loaded["bf16"], values.bfloat16()) and loaded["scalar"].item() == 3.5

    theirs = tmp_path / "theirs.safetensors"
    save_file({"w": values.bfloat16(), "s": values.to(torch.float8_e4m3fn)}, theirs, metadata={"k": "v"})
    assert assert_safetensors_agree(theirs) == 1
    header = read_header(theirs)
    assert header.metadata == {"k": "v"} and torch.equal(read_tensor(header.tensors["w"]), values.bfloat16())


def test_the_cross_check_fails_when_our_reader_is_wrong(tmp_path, monkeypatch):
    import safetensors_check

    path = tmp_path / "x.safetensors"
    write_safetensors(path, [planned("w", torch.arange(8, dtype=torch.float32))])
    real = safetensors_check.read_bytes
    monkeypatch.setattr(safetensors_check, "read_bytes", lambda e: bytes([real(e)[0] ^ 1]) + bytes(real(e)[1:]))
    with pytest.raises(AssertionError, match="w: bytes differ"):
        assert_safetensors_agree(path)
