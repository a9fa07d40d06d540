"""Cold-expert aliases: an aliased expert stores nothing, the manifest maps it to the expert that serves
it, the pack declares the loader feature, and verify accepts it (but not an alias to nothing)."""

from __future__ import annotations

import json

from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.model.targets import targets
from quantizer.pack.manifest import MANIFEST_NAME, Manifest
from quantizer.plan.plan import make_plan
from quantizer.plan.profiles import MIXEDK
from safetensors_check import assert_safetensors_agree

COLD, WARM = "layers.0.ffn.experts.7", "layers.0.ffn.experts.2"


def test_an_aliased_expert_stores_nothing_and_verifies(tiny_v41, tmp_path, capsys):
    cfg = Checkpoint.open(tiny_v41).config
    k = {t.key: (16.0 if t.key.startswith("layers.0.ffn.experts.") else None) for t in targets(cfg)}
    make_plan(cfg, k, loader=MIXEDK, aliases={COLD: WARM}).save(tmp_path / "plan.json")  # aliases need mixedk
    pack = tmp_path / "pack"
    assert main(["build", str(tiny_v41), "--plan", str(tmp_path / "plan.json"), "--out", str(pack), "--no-calibrate"]) == 0
    assert_safetensors_agree(pack)

    m = Manifest.load(pack)
    assert not [n for n in m.tensors if n.startswith(COLD + ".")]
    assert m.aliases == {f"{COLD}.{p}": f"{WARM}.{p}" for p in ("w1", "w2", "w3")}
    assert m.sources[f"{COLD}.w2.weight"] == {"alias": f"{WARM}.w2"} == m.sources[f"{COLD}.w2.scale"]
    assert m.loader_features == ["per-expert-K", "expert-aliases"] and m.plan["loader"] == MIXEDK
    assert m.quantization["k_histogram"] == {"16": 21}
    assert main(["verify", str(pack)]) == 0
    assert "OK    aliases: 3 aliased linears point at stored ones" in capsys.readouterr().out

    manifest = json.loads((pack / MANIFEST_NAME).read_text())
    manifest["aliases"][f"{COLD}.w1"] = "layers.0.ffn.experts.9.w1"
    (pack / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert main(["verify", str(pack)]) == 1
    assert f"FAULT {COLD}.w1: aliased to layers.0.ffn.experts.9.w1, which the pack does not store" in capsys.readouterr().out
