"""A new engine is one JSON file (docs/ARCHITECTURE.md, "A new engine profile"): a synthetic fifth profile,
registered through $QUANTIZER_LOADERS and named nowhere in the code, plans, builds, verifies, cards and fits
a pack through the same commands as the shipped four. A profile file with a fault, or one that takes a
shipped name, is one line, not a traceback.
"""

from __future__ import annotations

import json
import shutil

import pytest
from one_line import one_line

from quantizer import caches
from quantizer.cli import main
from quantizer.contract.loader_profiles import EXTRA_PROFILES, loader_names
from quantizer.contract.plan import Plan
from quantizer.pack.manifest import Manifest
from quantizer.shipped import shipped

NAME = "spark-serve"


def _profile_dir(tmp_path, monkeypatch, **changes):
    """A directory of one profile: vllm-exl3's rules under another name and card, with `changes`."""
    data = json.loads(shipped("configs", "loaders", "vllm-exl3.json").read_text())
    data.update(name=NAME, help="a synthetic engine of vLLM's launch shape", order=9, default_for=[], demo=False,
                card={"library_name": None, "tags": ["synthetic-engine"], "run": "vllm"})
    data.update(changes)
    folder = tmp_path / "loaders"
    folder.mkdir()
    (folder / f"{data['name']}.json").write_text(json.dumps(data))
    monkeypatch.setenv(EXTRA_PROFILES, str(folder))
    caches.reset()  # the profiles are read once a process


@pytest.fixture
def fifth(tmp_path, monkeypatch):
    _profile_dir(tmp_path, monkeypatch)
    yield
    caches.reset()


@pytest.mark.slow  # quantizes the bundled model's routed experts once (about a minute and a half on 2 cores)
def test_a_fifth_profile_plans_builds_verifies_cards_and_fits(fifth, tmp_path, capsys):
    assert loader_names()[-1] == NAME
    src = shutil.copytree(shipped("small_model"), tmp_path / "src")  # a copy: the pack links the source's shards
    plan_file, pack = tmp_path / "plan.json", tmp_path / "pack"
    assert main(["plan", str(src), "--bpw", "2", "--loader", NAME, "--out", str(plan_file)]) == 0
    assert Plan.load(plan_file).profile.name == NAME
    assert main(["build", str(src), "--plan", str(plan_file), "--out", str(pack), "--work", str(tmp_path / "work"),
                 "--no-calibrate"]) == 0
    assert Manifest.load(pack).profile.name == NAME
    capsys.readouterr()
    assert main(["verify", "--full", str(pack)]) == 0
    assert "clean" in capsys.readouterr().out
    assert main(["card", str(pack)]) == 0
    card = (pack / "README.md").read_text()
    assert f"- {NAME}" in card and "- synthetic-engine" in card  # the profile's tags
    assert f"quantizer knows no launch for `{NAME}`" in card and f"loader profile `{NAME}`" in card  # no runbook of its own
    capsys.readouterr()
    assert main(["fit", str(pack), "--sparks", "2", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["loader"] == NAME


def test_the_fifth_profile_is_in_the_help_and_not_in_the_demo(fifth):
    from quantizer.cli import build_parser
    from quantizer.demo.sweep import demo_loaders

    text = "".join(build_parser().parse_args(["plan", "--bpw", "2"]).parser.format_help().split())
    assert "".join(f"{NAME}: a synthetic engine of vLLM's launch shape".split()) in text  # argparse wraps at hyphens
    assert NAME not in demo_loaders()


@pytest.mark.parametrize("changes, needle", [
    ({"card": {"library_name": None, "tags": [], "run": "docker"}}, "card.run must be one of"),
    ({"layout": {"attention": "exl3"}}, "layout must give"),
    ({"name": "exllamav3"}, "has the name of a shipped loader profile"),
])
def test_a_faulty_profile_file_is_one_line(tmp_path, monkeypatch, capsys, changes, needle):
    _profile_dir(tmp_path, monkeypatch, **changes)
    _refused(capsys, needle)


def _refused(capsys, needle):
    try:
        assert main(["plan", "--model-config", "small-v41", "--bpw", "2", "--loader", "vllm-exl3"]) == 2
        one_line(capsys.readouterr().err, needle)
    finally:
        caches.reset()


def test_a_truncated_profile_file_or_a_missing_folder_is_one_line(tmp_path, monkeypatch, capsys):
    _profile_dir(tmp_path, monkeypatch)
    path = tmp_path / "loaders" / f"{NAME}.json"
    path.write_text(path.read_text()[:200])
    _refused(capsys, f"{path}: not a loader profile (JSONDecodeError")
    monkeypatch.setenv(EXTRA_PROFILES, str(tmp_path / "no-such-folder"))
    caches.reset()
    _refused(capsys, "no-such-folder: not a directory")
