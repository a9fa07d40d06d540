"""tests/gpu/device_cache.py: the GPU kit packed to travel with the repository unpacks to the same extension."""

from __future__ import annotations

import lzma
import subprocess
from pathlib import Path

import pytest
from script_module import script_module

SCRIPT = Path(__file__).resolve().parent / "gpu" / "device_cache.py"


@pytest.fixture(scope="module")
def device_cache():
    with script_module(SCRIPT) as module:
        yield module


def test_the_packed_kit_holds_the_wheels_and_the_extension_joined_in_order(device_cache, tmp_path):
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "exllamav3-1.6.5-py3-none-any.whl").write_bytes(b"wheel")
    (kit / "exllamav3_ext.so.01").write_bytes(b"second half" * 1000)
    (kit / "exllamav3_ext.so.00").write_bytes(b"first half" * 1000)
    out = tmp_path / "cache"
    out.mkdir()
    (out / "old.whl").write_bytes(b"a wheel of an earlier kit")  # would be installed beside the new ones
    size = device_cache.make(kit, out)
    assert sorted(p.name for p in out.iterdir()) == ["exllamav3-1.6.5-py3-none-any.whl", "exllamav3_ext.so.xz",
                                                    "setup.sh"]
    assert lzma.open(out / "exllamav3_ext.so.xz").read() == b"first half" * 1000 + b"second half" * 1000
    assert size == sum(p.stat().st_size for p in out.iterdir()) < 21000
    subprocess.run(["bash", "-n", str(out / "setup.sh")], check=True)  # the script it writes parses


def test_a_folder_that_is_not_the_kit_is_refused_in_one_line(device_cache, tmp_path):
    with pytest.raises(SystemExit, match="holds no \\*.whl or no exllamav3_ext.so.\\* parts: not the kit's folder"):
        device_cache.make(tmp_path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
