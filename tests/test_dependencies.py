"""What the project installs: ranges in pyproject.toml, exact pins in constraints.txt (torch the local CPU
build), which make and CI use; safetensors only as the dev extra's cross-check, zstandard an extra whose
absence is one line."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from quantizer.errors import UserError
from quantizer.textdata import read_texts

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_pyproject_declares_ranges_and_constraints_pin_every_dependency_torch_to_the_cpu_build():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    assert pins["torch"] == "2.13.0"  # the local CPU wheel; a newer torch would be a multi-GB CUDA build
    assert not [r for r in project["dependencies"] if "==" in r], "runtime dependencies are ranges"
    wanted = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    missing = {_requirement_name(r) for r in wanted if not r.startswith("quantizer")} - set(pins)
    assert not missing, f"constraints.txt pins no version of {sorted(missing)}"
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -c constraints.txt -e '.[dev]'" in makefile
    test_target = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert test_target.index("ruff check .") < test_target.index("pytest")


def test_safetensors_is_the_dev_extras_cross_check_and_zstandard_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_requirement_name(r) for r in project["dependencies"]}
    assert "safetensors" not in runtime and "zstandard" not in runtime  # the package imports neither
    assert any(_requirement_name(r) == "safetensors" for r in project["optional-dependencies"]["dev"])
    assert [_requirement_name(r) for r in project["optional-dependencies"]["zstd"]] == ["zstandard"]
    assert not [p for p in (ROOT / "quantizer").rglob("*.py") if re.search(r"^\s*(import|from) safetensors\b",
                                                                         p.read_text(), re.M)]


def test_a_zst_input_without_zstandard_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "text.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard -> ImportError
    with pytest.raises(UserError, match=r"text.jsonl.zst: reading .zst files needs the zstandard package: "
                                        r"pip install 'quantizer\[zstd\]'"):
        read_texts(path)


def test_make_demo_installs_the_demo_extra_alone_and_the_licence_is_an_spdx_string():
    """`make demo` on a fresh clone: the package and exllamav3 (the exl3 baseline), not the dev extra's
    gigabytes (triton, lm-eval and its datasets stack, transformers); `make setup` keeps the dev extra."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = data["project"]["optional-dependencies"]
    assert [_requirement_name(r) for r in extras["demo"]] == ["exllamav3"]
    assert "quantizer[demo,plots,zstd,eval]" in extras["dev"]  # make test runs the demo's tests too
    assert not {"triton", "lm-eval", "transformers", "accelerate"} & {_requirement_name(r) for r in extras["demo"]}
    makefile = (ROOT / "Makefile").read_text()
    demo = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert demo.split("\n")[0].strip() == "$(VENV)/.installed-demo"
    assert "pip install -q -c constraints.txt -e '.[demo]'" in makefile
    assert data["project"]["license"] == "MIT"  # SPDX (PEP 639): setuptools stops warning
    assert any(r.startswith("setuptools>=77") for r in data["build-system"]["requires"])
