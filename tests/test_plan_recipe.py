"""exllamav3 recipe.yaml: matching rules (last entry wins, every budgeted tensor covered, every
entry matches), our `native` and `mtp.` extensions, round trips, and the shipped named recipes."""

from __future__ import annotations

import errno
import fnmatch
import os

import pytest

from quantizer.checkpoint.config import ModelConfig
from quantizer.cli import main
from quantizer.contract.loader_profiles import EXLLAMAV3, TENSORFOLD, load_profile
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.exl3 import exl3_bytes
from quantizer.model.targets import stored_parts, target_map
from quantizer.plan.recipe import _KeyPool, plan_from_recipe, read_recipe, recipe_entries, shipped_recipes, write_recipe
from quantizer.plan.uniform import uniform_plan
from quantizer.shipped import model_config_path, shipped

RECIPE_HEAD = 'loader: exllamav3\ntarget_bpw: 3\nhead_bits: 6\ntensors:\n  "layers.*.ffn.experts.*": 3\n' \
              '  "layers.*.ffn.shared_experts.*": 4\n  "layers.*.attn.*": 4\n  "layers.*.engram.*": 4\n'


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.from_file(model_config_path("tiny-v41.json"))


@pytest.fixture
def v41(real_v41):  # tests/conftest.py: shared by the session
    return real_v41


def _recipe(tmp_path, body: str, name="r.yaml"):
    path = tmp_path / name
    path.write_text(body)
    return read_recipe(path)


def test_last_matching_entry_wins(tiny, tmp_path):
    r = _recipe(tmp_path, RECIPE_HEAD + '  "layers.*.ffn.experts.*.w2": 2\n  layers.3.ffn.experts.1.w2: 1.5\n'
                '  "layers.3.ffn.experts.*.w2": 2.5\n')
    plan = plan_from_recipe(tiny, r, profile=load_profile(EXLLAMAV3))
    assert plan.k["layers.3.ffn.experts.1.w2"] == 2.5  # the later pattern overrides the exact key
    assert plan.k["layers.4.ffn.experts.1.w2"] == 2.0 and plan.k["layers.4.ffn.experts.1.w1"] == 3.0
    assert plan.k["layers.2.attn.indexer.wq_b"] == 4.0  # `layers.*.attn.*` also covers the indexer
    assert plan.k["head"] == 6.0 and plan.k["mtp.0.attn.wq_a"] is None and plan.target_bpw == 3.0


def test_pattern_that_matches_nothing(tiny, tmp_path, capsys):
    r = _recipe(tmp_path, RECIPE_HEAD + '  "layers.*.ffn.expert.*": 2\n')
    with pytest.raises(UserError, match=r"pattern 'layers\.\*\.ffn\.expert\.\*' matches no budgeted tensor"):
        plan_from_recipe(tiny, r)
    # the CLI prints one line and exits 2
    tiny_config = str(model_config_path("tiny-v41.json"))
    code = main(["fit", "--model-config", tiny_config, "--recipe", str(tmp_path / "r.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "layers.*.ffn.expert.*" in err[0] and "matches no" in err[0]


def test_uncovered_and_invalid_values(tiny, tmp_path):
    r = _recipe(tmp_path, 'tensors:\n  "layers.*.ffn.experts.*": 3\n')
    with pytest.raises(UserError, match="budgeted tensor.*match no entry, e.g. layers.0.attn.wq_a"):
        plan_from_recipe(tiny, r)
    r = _recipe(tmp_path, RECIPE_HEAD + '  "layers.*.attn.*": 3.5\n')
    with pytest.raises(UserError, match="integer K only"):
        plan_from_recipe(tiny, r)
    r = _recipe(tmp_path, RECIPE_HEAD + '  "layers.*.ffn.experts.*": 2.5\n')
    with pytest.raises(UserError, match="needs the mul1 codebook"):
        plan_from_recipe(tiny, r, codebook="mcg")
    with pytest.raises(UserError, match="value 'four'"):
        _recipe(tmp_path, RECIPE_HEAD + '  "layers.*.attn.*": four\n')
    with pytest.raises(UserError, match="not valid YAML.*quote keys"):
        _recipe(tmp_path, "tensors:\n  *.ffn.experts.*: 3\n")
    with pytest.raises(UserError, match="needs a `tensors:` mapping"):
        _recipe(tmp_path, "target_bpw: 3\n")


def test_native_16_and_drafter_entries(tiny, tmp_path):
    r = _recipe(tmp_path, RECIPE_HEAD + '  "layers.*.attn.*": native\n  layers.0.ffn.shared_experts.w2: 16\n'
                '  "mtp.*.ffn.experts.*": 4\nhead_bits: native\n')
    plan = plan_from_recipe(tiny, r)
    tmap = target_map(tiny)
    assert plan.k["layers.0.attn.wq_b"] is None and plan.k["head"] is None
    assert plan.k["mtp.1.ffn.experts.3.w2"] == 4.0 and plan.k["mtp.1.attn.wq_a"] is None
    base = plan_from_recipe(tiny, _recipe(tmp_path, RECIPE_HEAD, "base.yaml"))
    attention_native = sum(t.native_bytes for t in tmap.values() if t.cls == "attention")
    attention_exl3 = sum(exl3_bytes(t.in_features, rows[1] - rows[0] if rows else t.out_features, 4)
                         for t in tmap.values() if t.cls == "attention" for _, rows in stored_parts(tiny, t, 4.0))
    assert plan.expected_bytes["attention"] - base.expected_bytes["attention"] == attention_native - attention_exl3
    w2 = tmap["layers.0.ffn.shared_experts.w2"]
    assert plan.expected_bytes["shared_expert"] - base.expected_bytes["shared_expert"] == \
        2 * w2.numel - exl3_bytes(w2.in_features, w2.out_features, 4)
    # an `mtp.` entry must match a drafter tensor; budgeted entries never touch the drafter
    with pytest.raises(UserError, match="matches no drafter tensor"):
        plan_from_recipe(tiny, _recipe(tmp_path, RECIPE_HEAD + '  "mtp.*.engram.*": 4\n'))


def test_written_recipes_round_trip(v41, tiny, tmp_path, real_v41_uniform):
    plan = real_v41_uniform(2.9)
    write_recipe(v41, plan, tmp_path / "r.yaml", header="a header\nline two")
    text = (tmp_path / "r.yaml").read_text()
    assert text.startswith("# a header\n# line two\n")
    back = plan_from_recipe(v41, read_recipe(tmp_path / "r.yaml"))
    assert back.k == plan.k and back.content_hash() == plan.content_hash()
    assert len(recipe_entries(v41, plan)) == 15  # default + 10 middle layers + 4 floors
    # a per-expert (tensorfold) plan with drafter entries round-trips too, and one with native entries
    k = dict(uniform_plan(tiny, 2.5, drafter_bits=3, profile=load_profile(TENSORFOLD)).k)
    k.update({"layers.3.ffn.experts.1.w2": 4.0, "mtp.2.ffn.experts.0.w1": 2.0})
    mixed = make_plan(tiny, k, profile=load_profile(TENSORFOLD))
    write_recipe(tiny, mixed, tmp_path / "m.yaml")
    assert plan_from_recipe(tiny, read_recipe(tmp_path / "m.yaml"), profile=load_profile(TENSORFOLD)).k == mixed.k
    native = dict(uniform_plan(tiny, 2.5).k, **{"layers.0.attn.wkv": None})
    partly = make_plan(tiny, native, profile=load_profile(EXLLAMAV3))
    write_recipe(tiny, partly, tmp_path / "n.yaml")
    assert plan_from_recipe(tiny, read_recipe(tmp_path / "n.yaml"), profile=load_profile(EXLLAMAV3)).k == partly.k


def test_a_recipe_means_what_it_says_about_the_head(tiny, tmp_path):
    """Without head_bits the head takes the last entry that matches its key (`"*": native` keeps it native), and
    exllamav3's 6 where none does; head_bits, where given, decides (issue 57)."""
    native = plan_from_recipe(tiny, _recipe(tmp_path, 'tensors:\n  "*": native\n  "layers.*.ffn.experts.*": 2\n'))
    assert native.head_bits is None and native.profile.name == "vllm-exl3"  # the routed-only layout vLLM loads
    assert plan_from_recipe(tiny, _recipe(tmp_path, 'tensors:\n  "*": 4\n')).head_bits == 4.0
    named = _recipe(tmp_path, 'head_bits: 5\ntensors:\n  "*": native\n  "layers.*.ffn.experts.*": 2\n')
    assert plan_from_recipe(tiny, named, profile=load_profile(TENSORFOLD), keep_rules=False).head_bits == 5.0
    assert plan_from_recipe(tiny, _recipe(tmp_path, RECIPE_HEAD.replace("head_bits: 6\n", ""))).head_bits == 6.0


def test_the_published_bit_maps_ship_and_are_found_by_name(v41, capsys):
    """configs/recipes/published: the bit maps of the packs people run, read by name from any install."""
    assert {"mia-2.9", "pollard-3.51", "sfxnz-2.0"} <= set(shipped_recipes())
    mia = plan_from_recipe(v41, read_recipe("mia-2.9"))
    assert mia.profile.name == "tensorfold" and mia.achieved_bpw == pytest.approx(2.9, abs=0.001)
    assert 196 < mia.expected_bytes["total_without_engram_tables"] / 2**30 < 197  # published: 196-197 GiB
    assert plan_from_recipe(v41, read_recipe("pollard-3.51")).achieved_bpw == pytest.approx(3.5, abs=0.001)
    with pytest.raises(UserError, match="recipe not found .shipped: .*mia-2.9"):
        read_recipe("mia-2.8")


@pytest.mark.parametrize("bpw", ["2.5", "2.9", "3.5"])
def test_shipped_recipes_are_what_uniform_plan_writes(v41, bpw, tmp_path, capsys):
    shipped_path = shipped("configs", "recipes", f"{bpw}.yaml")
    fresh = tmp_path / f"{bpw}.yaml"
    assert main(["plan", "--model-config", "deepseek-v4.1-flash", "--bpw", bpw, "--loader", "vllm-exl3",
                 "--recipe-out", str(fresh)]) == 0
    capsys.readouterr()
    assert fresh.read_text() == shipped_path.read_text(), "regenerate configs/recipes with the command in its header"
    plan = plan_from_recipe(v41, read_recipe(shipped_path))
    assert plan.achieved_bpw <= float(bpw) and plan.profile.name == "vllm-exl3"


def test_a_full_disk_while_writing_a_recipe_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert main(["plan", "--model-config", "tiny-v41", "--bpw", "3", "--method", "uniform", "--loader", "exllamav3",
                 "--recipe-out", str(tmp_path / "r.yaml")]) == 2
    assert "no space left on the device" in capsys.readouterr().err.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []  # no r.yaml.tmp


def test_glob_regex_agrees_with_fnmatch():
    names = ["layers.3.ffn.experts.5.w1", "layers.13.ffn.experts.5.w1", "layers.3.attn.indexer.wq_b", "head",
             "mtp.0.ffn.experts.12.w3", "layers.3.ffn.shared_experts.w2", "a[b"]
    patterns = ["layers.*.ffn.experts.*", "layers.?.ffn.*", "layers.[13].*", "layers.[!1]*", "*.w[12]", "*",
                "layers.3.*.w1", "a[b", "mtp.*.ffn.experts.1?.w3", "*indexer*"]
    pool = _KeyPool(names)
    for p in patterns:
        assert pool.match(p) == [n for n in names if fnmatch.fnmatchcase(n, p)], p
