"""From a plan to stored linears and work units; seeds; the job file's refusal messages; fingerprints."""

from __future__ import annotations

import shutil
from dataclasses import asdict

import pytest

from quantizer.checkpoint.fingerprint import source_fingerprint
from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.model.targets import targets
from quantizer.plan.uniform import uniform_plan
from quantizer.quantize.job import JobSpec, job_differences
from quantizer.quantize.linears import GPU_BATCH_BYTES, plan_units, tensor_seed, work_units
from quantizer.quantize.settings import QuantizeSettings
from quantizer.tiny.make import make_tiny
from quantizer.workdir import open_job


def _spec(fingerprint="sha256:a", seed=0) -> dict:
    return asdict(JobSpec({"fingerprint": fingerprint}, {"seed": seed}))


def _open(work, spec) -> bool:
    return open_job(work, spec, job_differences, "quantize job")


def test_wo_a_is_stored_as_exllamav3_slices_and_fp16_keeps_it_fused(tiny_v41):
    cfg = Checkpoint.open(tiny_v41).config
    k = {t.key: None for t in targets(cfg)}
    k.update({"layers.0.attn.wo_a": 4.0, "layers.1.attn.wo_a": 16.0, "layers.0.attn.wq_a": 4.0})
    linears = {s.key: s for s in pack_spec(cfg, make_plan(cfg, k)).encoded}
    width = cfg.o_lora_rank
    assert set(linears) == {"layers.0.attn.wq_a", "layers.0.attn.wo_a.slice.0", "layers.0.attn.wo_a.slice.1",
                            "layers.1.attn.wo_a"}
    assert linears["layers.0.attn.wo_a.slice.1"].rows == (width, 2 * width)
    assert linears["layers.0.attn.wo_a.slice.1"].out_features == width
    assert linears["layers.1.attn.wo_a"].rows is None


def test_units_one_per_linear_on_cpu_experts_batched_per_layer_and_projection_on_cuda(tiny_v41):
    cfg = Checkpoint.open(tiny_v41).config
    linears = pack_spec(cfg, uniform_plan(cfg, 2.5)).encoded
    cpu = work_units(linears, "cpu")
    cuda = work_units(linears, "cuda")
    assert [u.keys for u in cpu] == [(s.key,) for s in linears]
    batch = next(u for u in cuda if u.name.startswith("layers.3.ffn.experts.w2."))
    assert batch.keys == tuple(f"layers.3.ffn.experts.{e}.w2" for e in range(cfg.n_routed_experts))
    assert sorted(k for u in cuda for k in u.keys) == sorted(s.key for s in linears)
    assert all(u.weights * 4 <= GPU_BATCH_BYTES for u in cuda)


def test_seeds_depend_on_the_job_seed_and_the_key_only():
    assert tensor_seed(0, "layers.1.attn.wq_a") == tensor_seed(0, "layers.1.attn.wq_a")
    assert len({tensor_seed(s, k) for s in (0, 1) for k in ("head", "layers.1.attn.wq_a")}) == 4


def test_resume_is_refused_naming_what_changed(tmp_path):
    assert _open(tmp_path, _spec()) is False
    assert _open(tmp_path, _spec()) is True
    with pytest.raises(UserError, match="source fingerprint differs: sha256:a vs sha256:b; seed differs: 0 -> 1"):
        _open(tmp_path, _spec("sha256:b", seed=1))


def test_plans_sharing_a_linear_and_k_share_its_unit_and_other_settings_do_not(tiny_v41):
    cfg = Checkpoint.open(tiny_v41).config
    a, b = uniform_plan(cfg, 2.5), uniform_plan(cfg, 3.0)
    job = QuantizeSettings().record()

    def units(plan, job=job):
        return {u.name: u.digest for u in plan_units(pack_spec(cfg, plan), plan.codebook, job)}

    ua, ub = units(a), units(b)
    same_k = [key for key in ua if key in ub and a.k.get(key) == b.k.get(key) and a.k.get(key) is not None]
    assert same_k and all(ua[key] == ub[key] for key in same_k)
    changed = [key for key in ua if key in ub and a.k.get(key) != b.k.get(key)]
    assert changed and all(ua[key] != ub[key] for key in changed)
    reseeded = units(a, QuantizeSettings(seed=1).record())
    assert not set(reseeded.values()) & set(ua.values())


def test_fingerprint_tells_checkpoints_apart_by_config_and_weights(tmp_path, tiny_v41):
    copy = shutil.copytree(tiny_v41, tmp_path / "copy")
    other = make_tiny(tmp_path / "other", "v41", seed=1)  # same layout, other weights
    fp = source_fingerprint(Checkpoint.open(tiny_v41))
    assert source_fingerprint(Checkpoint.open(copy)) == fp
    assert source_fingerprint(Checkpoint.open(other)) != fp
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    assert source_fingerprint(Checkpoint.open(copy)) != fp
