"""`pip install .` (not editable) gets what the package reads at run time: the wheel holds both encoders'
sources (compiled on first use: codec/native.py, codec/kernel), the shipped configs and the bundled small
models, and nothing of tests/ or bench/. Built once, from a copy of the checkout (a build writes build/ and
*.egg-info beside its sources), without build isolation: setuptools and wheel come from the dev extra. 5 to 9 s
on 2 cores, so not marked slow."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The checkout's own folders a build neither reads nor should see: the venv, git, earlier build outputs, the
# GPU kit. Caches are skipped at every depth.
LOCAL_ONLY = {".venv", ".git", "build", "dist", ".device-cache", ".pytest_cache", ".ruff_cache"}
KERNEL_SOURCES = ("quantizer/codec/viterbi_kernel.cpp", "quantizer/codec/kernel/trellis_encode.cu")


def _not_copied(folder: str, names: list[str]) -> set[str]:
    skipped = {n for n in names if n == "__pycache__"}
    if Path(folder) == ROOT:
        skipped |= {n for n in names if n in LOCAL_ONLY or n.endswith(".egg-info")}
    return skipped


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> set[str]:
    """The paths the wheel of this checkout holds."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = shutil.copytree(ROOT, tmp / "source", ignore=_not_copied)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--no-cache-dir", "-q", "-w", str(tmp / "dist"), str(source)], capture_output=True, text=True)
    assert done.returncode == 0, f"pip wheel failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (wheel,) = (tmp / "dist").glob("quantizer-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def _shipped_as(folder: str, pattern: str, package: str) -> set[str]:
    """The wheel paths of the checkout's files `folder`/`pattern`, shipped in `package` (a dotted name)."""
    files = sorted(p for p in (ROOT / folder).glob(pattern) if p.is_file())
    assert files, f"{folder}/{pattern} matches no file of the checkout"
    return {"/".join([*package.split("."), p.relative_to(ROOT / folder).as_posix()]) for p in files}


def test_the_wheel_holds_both_encoder_sources(wheel_files):
    assert [s for s in KERNEL_SOURCES if s not in wheel_files] == []


def test_the_wheel_holds_the_shipped_configs_and_the_bundled_models(wheel_files):
    wanted = _shipped_as("configs", "loaders/*.json", "quantizer.configs")
    wanted |= _shipped_as("configs", "hardware/*.json", "quantizer.configs")
    for model in ("small_model", "small_model_v4", "small_model_v4_moe64"):
        wanted |= _shipped_as(f"quantizer/{model}", "*", f"quantizer.{model}")
    assert sorted(wanted - wheel_files) == []


def test_the_wheel_holds_nothing_of_tests_or_bench(wheel_files):
    assert sorted(n for n in wheel_files if {"tests", "bench"} & set(PurePosixPath(n).parts)) == []
