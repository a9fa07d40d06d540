"""The pack's model card: `build` writes README.md with Hugging Face front matter and figures equal to the
manifest's and `fit`'s; `ppl --record` changes only the manifest's measurement (and the digest that covers
it) and the card; verify faults a card that is not the manifest's, and `quantizer card` rewrites it.
A card is never written from claims edited by hand (bpw, K, base model, measurement): `card` and
`ppl --record` refuse them and verify faults them; a full disk leaves no temporary file; a --base-model
that is not a repository id never reaches a card."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil

from dataclasses import replace

import numpy as np
import pytest
from huggingface_hub import ModelCard

from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import build_parser, main
from quantizer.contract.rules import make_plan
from quantizer.pack.fit_table import pack_fit_table
from quantizer.model.targets import targets
from quantizer.pack.card import CARD_NAME, render_card, source_license
from quantizer.pack.manifest import MANIFEST_NAME, Manifest, TensorRecord

ENCODED = "layers.0.attn.wq_b"  # one EXL3 linear (K 2): a second of the CPU codec


@pytest.fixture(scope="module")
def built(tiny_v41, tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    cfg = Checkpoint.open(tiny_v41).config
    make_plan(cfg, {t.key: (2.0 if t.key == ENCODED else None) for t in targets(cfg)}).save(root / "plan.json")
    assert main(["build", str(tiny_v41), "--plan", str(root / "plan.json"), "--out", str(root / "pack"),
                 "--shard-size", "4M", "--no-calibrate", "--base-model", "example-org/tiny-v41"]) == 0
    np.save(root / "rows.npy", np.random.default_rng(5).integers(3, 4096, size=(2, 32)))
    return root


@pytest.fixture
def copy(built, tmp_path):
    return shutil.copytree(built / "pack", tmp_path / "pack")


def _front_matter(card: str) -> dict:
    """The metadata as huggingface_hub reads a model card (ModelCard parses the YAML block itself)."""
    assert card.startswith("---\n")
    return ModelCard(card).data.to_dict()


def _block(card: str, heading: str) -> list[list[str]]:
    """The rows of the fenced table under `heading`, split on runs of two or more spaces."""
    section = card[card.index(f"## {heading}\n"):]
    body = section[section.index("```\n") + 4:]
    lines = body[: body.index("```")].splitlines()[2:]  # past the header and its rule
    return [re.split(r"\s{2,}", line.strip()) for line in lines]


def test_build_writes_a_card_whose_front_matter_names_the_source_as_quantized(built):
    card = (built / "pack" / CARD_NAME).read_text()
    meta = _front_matter(card)
    assert meta["base_model"] == "example-org/tiny-v41" and meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "exllamav3"  # the pack's profile is stock exllamav3's
    assert {"exl3", "exllamav3"} <= set(meta["tags"])
    manifest = Manifest.load(built / "pack")
    assert manifest.source["fingerprint"] in card and manifest.plan["hash"] in card
    assert "--base-model example-org/tiny-v41" in card and "--no-calibrate" in card  # the rebuild command,
    assert "--out PACK" in card and str(built / "pack") not in card  # wherever the pack was written
    assert "not measured" in card


def test_the_cards_bits_per_class_are_the_manifests_totals(built):
    manifest = Manifest.load(built / "pack")
    rows = _block((built / "pack" / CARD_NAME).read_text(), "Bits")
    assert [r[0] for r in rows] == list(manifest.totals)
    for cls, tensors, _, params, bpw in rows:
        t = manifest.totals[cls]
        assert (int(tensors.replace(",", "")), int(params.replace(",", ""))) == (t["tensors"], t["params"])
        assert float(bpw) == pytest.approx(t["bpw"], abs=5e-4)
    assert f"K 2: {manifest.quantization['k_histogram']['2']}" in (built / "pack" / CARD_NAME).read_text()


def test_the_cards_bits_say_what_the_numbers_count(built):
    card = (built / "pack" / CARD_NAME).read_text()
    q = Manifest.load(built / "pack").quantization
    assert q["bits"] != q["bpw"]  # a pack whose rounded record differs: both numbers are explained
    assert (f"{q['bpw']:g} bits over the budgeted tensors (routed, shared, attention, indexer, engram); "
            f"exllamav3's record (quantization_config.json) rounds it to bits {q['bits']}; codebook mul1.") in card
    assert "EXL3 linears by K, the bits per weight each stores (16 = fp16): K 2: 1." in card
    assert f"bits {q['bits']}, " not in card


def _as_profile(m: Manifest, loader: str, routed_k: tuple[int, ...] = ()) -> Manifest:
    """The built manifest as a pack of `loader` would record it (its Engram folder or launch settings), with
    layer 1's routed experts at `routed_k`: the card is a function of the manifest, so each profile's card
    is rendered without building its pack (tests/test_engine_profiles.py and test_one_spark.py build them)."""
    extra = {"tensorfold": {"engram_dir": {"dir": "pack-Engram", "shards": ["model-00002-of-00003.safetensors"],
                                           "tables": 4}},
             "exllamav3-v41": {"launch": {"file": "launch.env", "cold_experts": 0, "cold_share": 0.0, "drafter": False}}}
    tensors = dict(m.tensors) | {f"layers.1.ffn.experts.{e}.w1.trellis": TensorRecord("x", k, "routed_expert")
                                 for e, k in enumerate(routed_k)}
    return replace(m, plan={**m.plan, "loader": loader, **extra.get(loader, {})}, tensors=tensors)


@pytest.mark.parametrize("loader, command", [
    ("exllamav3", 'config = Config.from_directory(".")\nmodel = Model.from_config(config)'),
    ("vllm-exl3", "EAGER=1 DSPARK=0 bash scripts/serve.sh 2\n"),
    ("tensorfold", "TF_DS_ENGRAM=$HOME/models/pack-Engram "),
    ("exllamav3-v41", "set -a; . ./launch.env; set +a\nMODEL_DIR=$PWD $HOME/dsv41-recipe/one-spark-tp1/scripts/run_tp1.sh"),
])
def test_each_profiles_card_says_how_to_run_it_and_names_only_an_engine_that_loads_it(built, loader, command):
    card = render_card(_as_profile(Manifest.load(built / "pack"), loader), None)
    run = card[card.index("## Run it\n"): card.index("## Bits")]
    assert any(command in block for block in run.split("```")[1::2])  # inside a fenced command (test_card_runbook.py)
    meta = _front_matter(card)
    assert meta["base_model"] == "example-org/tiny-v41" and meta["pipeline_tag"] == "text-generation"
    assert loader in meta["tags"] and "exl3" in meta["tags"]
    if loader == "exllamav3":
        assert meta["library_name"] == "exllamav3" and "library_name: exllamav3" in card
    else:  # stock exllamav3 cannot load it: the engine is a tag, no library claims it
        assert "library_name" not in meta and "library_name:" not in card
    assert ("vllm" in meta["tags"]) == (loader == "vllm-exl3")


def test_the_vllm_card_turns_on_the_per_expert_path_only_for_layers_of_mixed_k(built):
    m = Manifest.load(built / "pack")
    uniform = render_card(_as_profile(m, "vllm-exl3", (3, 3)), None)
    mixed = render_card(_as_profile(m, "vllm-exl3", (2, 3)), None)
    switch = "`VLLM_EXL3_TENSOR_MIXED_K=1` in the serving container turns on, eager"
    assert switch not in uniform and "is not needed" in uniform
    assert switch in mixed and "differ in K in 1 layer(s)" in mixed and "EAGER=1 DSPARK=0 bash scripts/serve.sh" in mixed
    given = replace(m, tool={**m.tool, "command": [*m.tool["command"], "--sparks", "4"]})
    four = render_card(_as_profile(given, "vllm-exl3"), None)
    assert "--tensor-parallel-size 4 --distributed-executor-backend ray" in four and "the build's `--sparks 4`" in four
    assert "bash scripts/serve.sh 4\n" in four and "serve.sh 2" not in four


def test_the_cards_fit_table_is_what_quantizer_fit_prints_for_the_pack(built, capsys):
    pack = built / "pack"
    fit = pack_fit_table(pack)  # the manifest keeps no verdict: the card's is computed from the headers
    rows = _block((pack / CARD_NAME).read_text(), "Fit on DGX Sparks")
    want = [(s, e) for s, engines in fit["topologies"].items() for e in engines]
    assert [(r[0], r[1]) for r in rows] == want and rows
    engine = Manifest.load(pack).profile.fit_engine
    assert {r[1] for r in rows} == {engine}  # the engine that loads the pack, never the design floor `native`
    for sparks, _, fits, weights, free, context, decode in rows:
        capsys.readouterr()
        code = main(["fit", str(pack), "--sparks", sparks, "--context", str(fit["context"]), "--json"])
        report = json.loads(capsys.readouterr().out)
        assert (code == 0) == (fits == "yes") == report["fits"]
        assert decode.split(" ")[0] == f"{report['decode']['tokens_per_second']:.1f}"  # the decode model's rate
        assert weights.split(" / ") == [f"{round(r['weights_gib'], 3):,.3f}" for r in report["ranks"]]
        assert free.split(" / ") == [f"{round(r['free_gib'], 3):,.3f}" for r in report["ranks"]]
        assert int(context.replace(",", "")) == fit["topologies"][sparks][engine]["max_context"]


def test_record_changes_only_the_measurement_and_the_card(built, copy, tiny_v41, capsys):
    before = json.loads((copy / MANIFEST_NAME).read_text())
    card_before = (copy / CARD_NAME).read_text()
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in copy.iterdir()}
    assert main(["ppl", str(copy), "--against", str(tiny_v41), "--tokens", str(built / "rows.npy"), "--record", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    after = json.loads((copy / MANIFEST_NAME).read_text())
    signed = ("measurement", "claims_sha256")
    assert {k: v for k, v in after.items() if k not in signed} == {k: v for k, v in before.items() if k not in signed}
    assert before["measurement"] is None
    assert after["claims_sha256"] != before["claims_sha256"] == Manifest.load(built / "pack").claims_digest()
    assert after["claims_sha256"] == Manifest.load(copy).claims_digest()  # the digest now covers the measurement
    m = after["measurement"]
    assert m["text"] == "rows.npy" and m["text_sha256"] == hashlib.sha256((built / "rows.npy").read_bytes()).hexdigest()
    assert (m["rows"], m["cols"], m["tokens"]) == (2, 32, printed["tokens"])
    for key in ("kl", "kl_stderr", "kl_p95", "top1", "top1_stderr", "ppl", "ppl_source", "nll_delta", "nll_delta_stderr"):
        assert m[key] == printed[key]
    assert Manifest.load(copy).measurement.ppl_ratio == printed["ppl_ratio"]  # the ratio of the two recorded
    assert m["engine"] == {"name": "quantizer reference forward", "version": before["tool"]["version"],
                           "device": "cpu", "dtype": "float32"}
    changed = {p.name for p in copy.iterdir() if files.get(p.name) != hashlib.sha256(p.read_bytes()).hexdigest()}
    assert changed == {MANIFEST_NAME, CARD_NAME}
    card = (copy / CARD_NAME).read_text()
    assert card != card_before and "not measured" not in card
    quality = dict(_block(card, "Quality"))
    assert quality["KL(source || pack), nats/token"] == f"{m['kl']:.5f} ± {m['kl_stderr']:.5f}"
    assert quality["perplexity, pack"] == f"{m['ppl']:.4f}" and quality["perplexity, source"] == f"{m['ppl_source']:.4f}"
    assert quality["NLL delta (pack - source), nats/token"] == f"{m['nll_delta']:+.5f} ± {m['nll_delta_stderr']:.5f}"
    assert quality["KL 95th percentile over the tokens, nats"] == f"{m['kl_p95']:.5f}"
    assert quality["perplexity ratio (pack / source)"] == f"{printed['ppl_ratio']:.4f}"
    assert main(["verify", str(copy)]) == 0


def test_a_measurement_recorded_before_the_kl_p95_still_vouches_and_cards_it_as_not_recorded(built, copy, tiny_v41,
                                                                                             capsys):
    """A manifest signed by a quantizer whose record had no kl_p95 keeps its digest: it is carded and verified,
    the p95 said to be not recorded and the ratio computed from the two perplexities it holds."""
    assert main(["ppl", str(copy), "--against", str(tiny_v41), "--tokens", str(built / "rows.npy"), "--record"]) == 0
    old = json.loads((copy / MANIFEST_NAME).read_text())
    del old["measurement"]["kl_p95"]
    claims = {k: v for k, v in old.items() if k != "claims_sha256"}  # signed as the older quantizer signed it
    old["claims_sha256"] = "sha256:" + hashlib.sha256(json.dumps(claims, sort_keys=True, separators=(",", ":"))
                                                      .encode()).hexdigest()
    (copy / MANIFEST_NAME).write_text(json.dumps(old, indent=1))
    m = Manifest.load(copy)
    assert m.claims_problem() is None and m.measurement.kl_p95 is None
    assert m.to_dict() == old  # written back unchanged: no kl_p95 key added
    capsys.readouterr()
    assert main(["card", str(copy)]) == 0
    quality = dict(_block((copy / CARD_NAME).read_text(), "Quality"))
    assert quality["KL 95th percentile over the tokens, nats"] == "not recorded"
    ratio = old["measurement"]["ppl"] / old["measurement"]["ppl_source"]
    assert quality["perplexity ratio (pack / source)"] == f"{ratio:.4f}"
    assert main(["verify", str(copy)]) == 0


def test_record_without_a_source_to_compare_with_is_refused_in_one_line(built, capsys):
    assert main(["ppl", str(built / "pack"), "--tokens", str(built / "rows.npy"), "--record"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--record writes into a pack" in err[0]


def test_verify_faults_an_edited_or_missing_card_and_quantizer_card_rewrites_it(copy, capsys):
    card = copy / CARD_NAME
    card.write_text(card.read_text().replace("not measured", "KL 0.001"))
    assert main(["verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"FAULT {CARD_NAME}: is not the card this quantizer writes for this manifest" in out
    assert f"regenerate it with `quantizer card {copy}`" in out
    card.unlink()
    assert main(["verify", str(copy)]) == 1
    assert f"FAULT {CARD_NAME}: missing" in capsys.readouterr().out
    assert main(["card", str(copy)]) == 0
    assert card.read_text() == render_card(Manifest.load(copy), pack_fit_table(copy))
    assert main(["verify", str(copy)]) == 0


def test_a_fit_section_of_another_hardware_profile_is_reported_not_a_fault(copy, capsys):
    card = copy / CARD_NAME
    text = card.read_text()
    head, _, rest = text.partition("## Fit on DGX Sparks")
    card.write_text(head + "## Fit on DGX Sparks\n\ncomputed against last year's profile." + rest[rest.find("\n## "):])
    assert main(["verify", str(copy)]) == 0
    assert "its fit section was computed against another hardware profile" in capsys.readouterr().out


def test_the_license_comes_from_the_source_cards_front_matter(tmp_path):
    (tmp_path / CARD_NAME).write_text("---\nlicense: mit\nlibrary_name: transformers\n---\n# Model\n")
    assert source_license(tmp_path) == "mit"
    (tmp_path / CARD_NAME).write_text("# Model without front matter\n")
    assert source_license(tmp_path) is None


TYPED_MEASUREMENT = {
    "text": "heldout.jsonl", "text_sha256": "0" * 64, "rows": 16, "cols": 512, "tokens": 8176, "kl": 0.001,
    "kl_stderr": 0.0001, "top1": 0.99, "top1_stderr": 0.001, "ppl": 36.0, "ppl_source": 36.0, "nll_delta": 0.0,
    "nll_delta_stderr": 0.001, "engine": {"name": "x", "version": "1", "device": "cpu", "dtype": "float32"}}


def _edit(pack, edit) -> None:
    """Apply `edit` to manifest.json as a person with a text editor would (the digest left as it was)."""
    manifest = json.loads((pack / MANIFEST_NAME).read_text())
    edit(manifest)
    (pack / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))


def _files(pack) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pack.iterdir())}


def _refused_everywhere(pack, capsys, built, source) -> None:
    """`card` and `ppl --record` refuse the manifest in one line and change nothing; verify --full faults it."""
    before = _files(pack)
    capsys.readouterr()
    assert main(["card", str(pack)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{pack / MANIFEST_NAME}: was edited after packing" in err[0] and "rebuild" in err[0]
    assert main(["ppl", str(pack), "--against", str(source), "--tokens", str(built / "rows.npy"), "--record"]) == 2
    assert "was edited after packing" in capsys.readouterr().err
    assert _files(pack) == before
    assert main(["verify", str(pack), "--full"]) == 1
    assert f"FAULT {MANIFEST_NAME}: was edited after packing" in capsys.readouterr().out


@pytest.mark.parametrize("edit", [
    lambda m: m["quantization"].__setitem__("bpw", 4.0),  # 2.5 -> 4.0, as the user did
    lambda m: m["quantization"]["k_histogram"].__setitem__("2", 99),
    lambda m: m["tensors"][f"{ENCODED}.trellis"].__setitem__("K", 4),  # the K map
    lambda m: m["source"].__setitem__("base_model", "other-org/a-bigger-model"),
    lambda m: m["totals"]["attention"].__setitem__("bpw", 1.0),
    lambda m: m["files"]["config.json"].__setitem__("bytes", 1),
    lambda m: m.__setitem__("measurement", TYPED_MEASUREMENT),  # a quality figure typed in, never measured
])
def test_a_hand_edited_claim_is_never_carded_and_verify_faults_it(built, copy, tiny_v41, capsys, edit):
    _edit(copy, edit)
    _refused_everywhere(copy, capsys, built, tiny_v41)


def test_an_edited_recorded_measurement_is_never_carded(built, copy, tiny_v41, capsys):
    assert main(["ppl", str(copy), "--against", str(tiny_v41), "--tokens", str(built / "rows.npy"), "--record"]) == 0
    assert main(["verify", str(copy), "--full"]) == 0
    for key, value in (("kl", 0.0001), ("ppl", 1.5)):
        pack = shutil.copytree(copy, copy.parent / key)
        _edit(pack, lambda m: m["measurement"].__setitem__(key, value))
        _refused_everywhere(pack, capsys, built, tiny_v41)


def test_a_manifest_of_the_previous_version_is_refused_in_one_line_saying_to_rebuild(copy, capsys):
    _edit(copy, lambda m: m.__setitem__("manifest_version", 2))
    for command in (["verify", str(copy)], ["card", str(copy)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "manifest_version 2, written before packs recorded the files they own" in err[0]
        assert "rebuild the pack with this quantizer" in err[0]


def test_a_full_disk_while_writing_the_card_or_the_measurement_leaves_no_temporary_file(built, copy, tiny_v41,
                                                                                          capsys, monkeypatch):
    before = _files(copy)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert main(["card", str(copy)]) == 2
    assert "no space left on the device" in capsys.readouterr().err
    assert main(["ppl", str(copy), "--against", str(tiny_v41), "--tokens", str(built / "rows.npy"), "--record"]) == 2
    assert "no space left on the device" in capsys.readouterr().err.strip().splitlines()[-1]
    assert _files(copy) == before  # no README.md.tmp, no manifest.json.tmp, nothing changed


@pytest.mark.parametrize("base_model", ["not a repo", "../../etc/passwd", "org/name\n---\nlicense: other", "just-a-name",
                                        "org/-name-", "org/na..me"])
def test_a_base_model_that_is_not_a_repository_id_is_refused_before_any_work(base_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["build", "src", "--bpw", "3", "--out", str(tmp_path / "o"),
                                   "--base-model", base_model])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"quantizer build: error: argument --base-model: {base_model!r}: a repository id is ")
    assert "Traceback" not in "\n".join(err) and not (tmp_path / "o").exists()
