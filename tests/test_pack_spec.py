"""The pack spec (contract/pack_spec.py) is one list every stage reads: its quick byte count equals the sum of
its tensors, encoded targets replace exactly their native weight and scale, aliased experts and wo_a
slicing follow the loader's layout."""

from __future__ import annotations

import pytest

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import EXLLAMAV3, TENSORFOLD, VLLM_EXL3, load_profile
from quantizer.contract.pack_spec import EXL3, NATIVE, pack_spec, spec_bytes
from quantizer.contract.rules import make_plan
from quantizer.model.targets import targets
from quantizer.plan.uniform import uniform_plan
from quantizer.shipped import model_config_path

WARM = "layers.2.ffn.experts.0"


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_file(model_config_path("tiny-v41.json"))


def _plans(cfg):
    k = {t.key: 4.0 for t in targets(cfg)}
    k["layers.0.attn.wo_a"] = 16.0
    return {
        "uniform": uniform_plan(cfg, 2.5),
        "native": make_plan(cfg, {t.key: None for t in targets(cfg)}),
        "fp16": make_plan(cfg, k, profile=load_profile(EXLLAMAV3)),
        "tensorfold": uniform_plan(cfg, 2.5, profile=load_profile(TENSORFOLD)),
        "vllm-exl3": uniform_plan(cfg, 2.5, profile=load_profile(VLLM_EXL3)),
    }


@pytest.mark.parametrize("which", ["uniform", "native", "fp16", "tensorfold", "vllm-exl3"])
def test_quick_bytes_equal_the_tensors_of_the_spec(cfg, which):
    plan = _plans(cfg)[which]
    spec = pack_spec(cfg, plan)
    assert spec_bytes(cfg, plan) == spec.bytes_by_class()
    assert len({t.name for t in spec.tensors}) == len(spec.tensors)  # no tensor twice


def test_encoded_targets_replace_weight_and_scale(cfg):
    plan = _plans(cfg)["fp16"]
    spec = pack_spec(cfg, plan)
    names = {t.name for t in spec.tensors}
    assert f"{WARM}.w1.trellis" in names and f"{WARM}.w1.weight" not in names and f"{WARM}.w1.scale" not in names
    fused = [t for t in spec.tensors if t.name.startswith("layers.0.attn.wo_a.")]
    assert [(t.name, t.dtype, t.storage, t.K) for t in fused] == [("layers.0.attn.wo_a.weight", "F16", NATIVE, None)]
    sliced = sorted(t.name for t in spec.tensors if t.name.startswith("layers.1.attn.wo_a.") and t.storage == EXL3)
    assert sliced == [f"layers.1.attn.wo_a.slice.{g}.{leaf}" for g in range(cfg.o_groups)
                      for leaf in ("mul1", "suh", "svh", "trellis")]
    native = pack_spec(cfg, _plans(cfg)["native"])
    assert not native.encoded and all(t.storage == NATIVE and t.linear is None for t in native.tensors)
