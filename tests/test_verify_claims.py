"""What a manifest sums up of its pack (bpw, bits, K histogram, head bits, each class's totals, each tensor's K
and class) and the pack's k_map.json are recomputed by verify from the plan its shards carry: a false claim
under a digest made again with the library's own Manifest (issue 60, item 4) is a fault naming the claim, the
claimed and the real value, and `card` and `ppl --record` refuse it in one line. Every pack holds k_map.json,
as its own recorded file, equal to what its shards hold (issue 61, item 7)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from one_line import one_line

from quantizer.checkpoint.fingerprint import sha256_file
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.contract.rules import make_plan
from quantizer.model.targets import targets
from quantizer.pack.manifest import K_MAP_NAME, MANIFEST_NAME, NATIVE, SOURCE_FORM, FileRecord, Manifest, TensorRecord
from quantizer.pack.owned import owned_files
from quantizer.workdir import write_json_atomic

ENCODED = "layers.0.attn.wq_b"  # EXL3 at K 2 (a second of the CPU codec)
FP16 = "layers.1.attn.wq_a"  # kept as an fp16 weight (K 16)


@pytest.fixture(scope="module")
def built(tiny_v41, tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")
    cfg = Checkpoint.open(tiny_v41).config
    k = {t.key: 2.0 if t.key == ENCODED else 16.0 if t.key == FP16 else None for t in targets(cfg)}
    make_plan(cfg, k).save(root / "plan.json")
    assert main(["build", str(tiny_v41), "--plan", str(root / "plan.json"), "--out", str(root / "pack"),
                 "--shard-size", "4M", "--no-calibrate"]) == 0
    np.save(root / "rows.npy", np.random.default_rng(5).integers(3, 4096, size=(2, 32)))
    return root


@pytest.fixture
def copy(built, tmp_path):
    return shutil.copytree(built / "pack", tmp_path / "pack")


def _forge(pack, edit) -> None:
    """Edit the manifest as the issue's attacker did: through the library's own Manifest, whose to_dict
    writes a digest of the edited claims."""
    manifest = Manifest.load(pack)
    edit(manifest)
    write_json_atomic(pack / MANIFEST_NAME, manifest.to_dict())


def _verify(pack, capsys) -> tuple[int, list[str]]:
    code = main(["verify", str(pack), "--full"])
    return code, [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAULT")]


def _native_drafter_tensor(manifest: Manifest) -> str:
    return next(n for n, t in manifest.tensors.items() if t.cls == "dspark_drafter" and t.K == NATIVE)


def test_an_honest_pack_verifies_clean_and_holds_its_k_map(built, capsys):
    pack = built / "pack"
    code, faults = _verify(pack, capsys)
    assert code == 0 and faults == []
    manifest = Manifest.load(pack)
    assert K_MAP_NAME in manifest.files and K_MAP_NAME in owned_files(manifest)
    k_map = json.loads((pack / K_MAP_NAME).read_text())
    assert k_map[ENCODED] == 2 and k_map[FP16] == 16 and k_map["layers.1.attn.wq_b"] == SOURCE_FORM
    assert {k for k in k_map.values() if k != SOURCE_FORM} == {2, 16}
    assert sum(k != SOURCE_FORM for k in k_map.values()) == sum(manifest.quantization["k_histogram"].values())
    assert f"`{K_MAP_NAME}`" in (pack / "README.md").read_text()


# (what the attacker writes, the claim the fault names, the value it names as the real one)
FORGED = [
    (lambda m: m.quantization.__setitem__("bpw", 4.0), "bpw claims 4.0", lambda m: m.quantization["bpw"]),
    (lambda m: m.quantization.__setitem__("bits", 4), "bits claims 4", lambda m: m.quantization["bits"]),
    (lambda m: m.quantization.__setitem__("k_histogram", {"3": 1, "16": 1}), 'k_histogram claims {"16": 1, "3": 1}',
     lambda m: json.dumps(m.quantization["k_histogram"], sort_keys=True)),
    (lambda m: m.plan.__setitem__("head_bits", 6), "head_bits claims 6", lambda m: m.plan["head_bits"]),
    (lambda m: m.totals["attention"].__setitem__("bytes", 1), "totals[attention] claims",
     lambda m: json.dumps(m.totals["attention"], sort_keys=True)),
    (lambda m: m.totals["routed_expert"].__setitem__("bpw", 2.0), "totals[routed_expert] claims",
     lambda m: json.dumps(m.totals["routed_expert"], sort_keys=True)),
]


@pytest.mark.parametrize("edit,claim,real", FORGED, ids=["bpw", "bits", "k_histogram", "head_bits", "class bytes",
                                                          "class bpw"])
def test_a_false_summary_under_a_fresh_digest_is_a_fault_and_never_carded(built, copy, tiny_v41, capsys, edit, claim,
                                                                           real):
    honest = Manifest.load(copy)
    _forge(copy, edit)
    assert Manifest.load(copy).claims_problem() is None  # the digest checks: only the recomputation can tell
    code, faults = _verify(copy, capsys)
    named = [line for line in faults if line.startswith(f"FAULT {MANIFEST_NAME}: ")]
    assert code == 1 and len(named) == 1, faults
    assert named[0].startswith(f"FAULT {MANIFEST_NAME}: {claim}")
    assert named[0].endswith(f"the plan and shards give {real(honest)}")
    _refused(copy, built, tiny_v41, capsys, claim)


def test_a_false_tensor_record_is_a_fault_naming_the_tensor(built, copy, tiny_v41, capsys):
    name = _native_drafter_tensor(Manifest.load(copy))
    _forge(copy, lambda m: m.tensors.__setitem__(name, TensorRecord(m.tensors[name].shard, 5, "head")))
    code, faults = _verify(copy, capsys)
    assert code == 1 and f"FAULT {MANIFEST_NAME}: tensors: 1 record(s) differ from the shards, e.g. {name} claims K 5 " \
                         "(head), the plan and shards give K native (dspark_drafter)" in faults
    _refused(copy, built, tiny_v41, capsys, f"tensors: 1 record(s) differ from the shards, e.g. {name} claims K 5")


def test_a_false_k_map_with_its_record_and_digest_redone_is_a_fault(copy, capsys):
    k_map = json.loads((copy / K_MAP_NAME).read_text())
    k_map[ENCODED] = 4
    (copy / K_MAP_NAME).write_text(json.dumps(k_map))
    record = FileRecord((copy / K_MAP_NAME).stat().st_size, sha256_file(copy / K_MAP_NAME))
    _forge(copy, lambda m: m.files.__setitem__(K_MAP_NAME, record))
    code, faults = _verify(copy, capsys)
    assert code == 1 and faults == [f"FAULT {K_MAP_NAME}: 1 linear(s) differ from the shards, e.g. {ENCODED}: "
                                    "claims 4, the shards hold 2"]


def test_a_pack_without_its_k_map_is_a_fault(copy, capsys):
    (copy / K_MAP_NAME).unlink()
    _forge(copy, lambda m: m.files.pop(K_MAP_NAME))
    code, faults = _verify(copy, capsys)
    assert code == 1 and any(line.startswith(f"FAULT {K_MAP_NAME}: not in the pack") for line in faults), faults


def test_an_edited_k_map_is_a_fault_naming_it(copy, capsys):
    (copy / K_MAP_NAME).write_text("{}")
    code, faults = _verify(copy, capsys)
    assert code == 1 and f"FAULT {K_MAP_NAME}: not the file the pack stage wrote" in faults[0]


def _refused(pack, built, source, capsys, claim: str) -> None:
    """`card`, `fit` and `ppl --record` refuse the pack in one line naming the claim, and change nothing."""
    before = {p.name: p.read_bytes() for p in pack.iterdir()}
    assert main(["card", str(pack)]) == 2
    one_line(capsys.readouterr().err, f"{pack / MANIFEST_NAME}: {claim}", "rebuild the pack")
    assert main(["fit", str(pack)]) == 2
    one_line(capsys.readouterr().err, f"{pack / MANIFEST_NAME}: {claim}", "rebuild the pack")
    assert main(["ppl", str(pack), "--against", str(source), "--tokens", str(built / "rows.npy"), "--record"]) == 2
    one_line(capsys.readouterr().err, claim)
    assert {p.name: p.read_bytes() for p in pack.iterdir()} == before
