"""The tune stage (`build --tune`): the factorisation it trains through, that it lowers the held-out
block-output error, that the pack it feeds differs from an untuned one only in EXL3 suh/svh and still
verifies, that a killed run resumes from its finished blocks, and what bad input gets."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from quantizer.checkpoint.safetensors_file import PAD_PREFIX, read_bytes, read_header
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.codec import dequantize, quantize_linear
from quantizer.errors import UserError
from quantizer.pack.manifest import Manifest
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.pipeline.build import PLAN_FILE, QUANTIZE_DIR, BuildRequest, build
from quantizer.model.targets import targets
from quantizer.plan.plan import Plan, make_plan
from quantizer.tune import stage
from quantizer.tune.factor import factor
from quantizer.tune.settings import TuneSettings
from quantizer.tune.store import TunedStore

# Few tokens: a measurement after every step, since a tiny block's scales over-fit 12 rows within a few
SETTINGS = TuneSettings(steps=4, lr=1e-2, eval_every=1, patience=3, batch_rows=4)
TUNED_BLOCKS = ("layers.0", "layers.1")


def _plan(cfg):
    """K 2 for the attention and shared expert of the first two blocks (wo_a among
    them: two slices), one fp16 linear (K 16: used as stored, not tuned); the rest native. A few linears
    keep the CPU encoder's share of the test small."""
    def k(t):
        if not t.key.startswith(tuple(b + "." for b in TUNED_BLOCKS)):
            return None
        if t.key == "layers.1.attn.wq_b":
            return 16.0
        return 2.0 if ".attn.w" in t.key or "shared_experts" in t.key else None
    return make_plan(cfg, {t.key: k(t) for t in targets(cfg)})


@pytest.fixture(scope="module")
def packs(tiny_v41, tmp_path_factory):
    """One work directory, two packs of the same plan and codes: untuned, then tuned (the unit KL
    measurement is left out of the calibration: a given plan does not read it)."""
    root = tmp_path_factory.mktemp("tune")
    rows = torch.from_numpy(np.random.default_rng(0).integers(3, 200, size=(16, 64)))
    torch.save(rows, root / "rows.pt")
    plan = _plan(Checkpoint.open(tiny_v41).config)

    def request(out: str, tune: TuneSettings | None) -> BuildRequest:
        return BuildRequest(str(tiny_v41), root / out, plan=plan, calibration_rows=rows,
                            calibration=CalibrationSettings(measure_kl=False), work=root / "work", tune=tune)

    build(request("plain", None))
    result = build(request("tuned", SETTINGS))
    assert result.tuned.blocks == result.tuned.tuned == len(TUNED_BLOCKS)
    return root


def test_the_factorisation_reproduces_the_decoder():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 128, generator=gen)
    x = torch.randn(512, 128, generator=gen) * torch.linspace(0.2, 3, 128)
    q = quantize_linear(w, 2, x.T @ x, 512)
    f = factor(q)
    expected = dequantize(q)
    assert f.weight().shape == expected.shape == (256, 128)
    torch.testing.assert_close(f.weight(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))
    doubled = f.weight(q.suh.float() * 2, q.svh.float() * 3)  # the scales enter linearly, on their own axes
    torch.testing.assert_close(doubled, 6 * expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_tuning_lowers_the_held_out_block_output_error(packs):
    store = TunedStore(packs / "work")
    infos = [store.info(p) for p in sorted(store.dir.glob("*.safetensors"))]
    assert infos, "no tuned block files"
    ratios = [i["error_after"] / i["error_before"] for i in infos]
    assert all(r <= 1.0 for r in ratios)  # the best held-out step wins, the stored scales included
    assert min(ratios) < 0.99, ratios  # and tuning found a real improvement somewhere (layers.0: 0.981)
    tuning = Manifest.load(packs / "tuned").settings["tuning"]
    assert tuning["steps"] == SETTINGS.steps and tuning["tune_rows"] + tuning["heldout_rows"] == 16
    assert "tuning" not in Manifest.load(packs / "plain").settings


def test_the_tuned_pack_verifies_and_differs_only_in_exl3_scales(packs):
    assert main(["verify", "--full", str(packs / "tuned")]) == 0
    plain = {n: e for p in sorted((packs / "plain").glob("*.safetensors")) for n, e in read_header(p).tensors.items()
             if not n.startswith(PAD_PREFIX)}
    tuned = {n: e for p in sorted((packs / "tuned").glob("*.safetensors")) for n, e in read_header(p).tensors.items()
             if not n.startswith(PAD_PREFIX)}
    assert plain.keys() == tuned.keys()
    changed = set()
    for name, e in plain.items():
        t = tuned[name]
        assert (t.dtype, tuple(t.shape)) == (e.dtype, tuple(e.shape)), name
        if read_bytes(t) != read_bytes(e):
            changed.add(name)
    assert changed and all(n.startswith("layers.") and n.endswith((".suh", ".svh")) for n in changed), sorted(changed)[:5]
    native = [n for n in plain if not n.endswith((".trellis", ".suh", ".svh", ".mul1", ".mcg"))]
    assert native and not changed & set(native)
    sizes = [p.stat().st_size for p in sorted((packs / "plain").glob("*.safetensors"))]
    assert sizes == [p.stat().st_size for p in sorted((packs / "tuned").glob("*.safetensors"))]


def test_a_killed_run_resumes_from_its_finished_blocks(packs, tiny_v41, tmp_path, monkeypatch):
    ck = Checkpoint.open(tiny_v41)
    plan = Plan.load(packs / "work" / PLAN_FILE)
    job = {k: v for k, v in Manifest.load(packs / "plain").settings.items()}
    rows = torch.load(packs / "rows.pt")[:4, :32]  # 3 tuning rows, 1 held out: the forward is what costs
    # quantized inputs fitted to the native model's stream: each block's file also covers the one before
    settings = TuneSettings(steps=2, eval_every=2, batch_rows=4, inputs="quantized", target="model")
    real, calls = stage.tune_block, []

    def dies_on_the_second_block(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(stage, "tune_block", dies_on_the_second_block)
    with pytest.raises(KeyboardInterrupt):
        stage.tune(ck, plan, packs / "work" / QUANTIZE_DIR, tmp_path, rows, settings, job, say=lambda line: None)
    monkeypatch.setattr(stage, "tune_block", real)
    result = stage.tune(ck, plan, packs / "work" / QUANTIZE_DIR, tmp_path, rows, settings, job, say=lambda line: None)
    assert result.blocks == len(TUNED_BLOCKS)
    assert result.tuned == result.blocks - 1  # the first block came from the killed run's file
    again = stage.tune(ck, plan, packs / "work" / QUANTIZE_DIR, tmp_path, rows, settings, job, say=lambda line: None)
    assert again.tuned == 0 and again.files == result.files


def test_tune_without_calibration_is_refused_in_one_line(tiny_v41, tmp_path, capsys):
    code = main(["build", str(tiny_v41), "--bpw", "2.5", "--method", "uniform", "--no-calibrate", "--tune",
                 "--out", str(tmp_path / "pack")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--tune" in err and "--no-calibrate" in err
    assert not (tmp_path / "pack").exists()


def test_a_source_byte_changed_during_tuning_keeps_no_tuned_block(packs, src, tmp_path, capsys, monkeypatch):
    """Blocks tuned from changed bytes are deleted before the refusal, like the units encoded from them,
    so a rerun with the bytes put back never reuses them."""
    build_module = importlib.import_module("quantizer.pipeline.build")  # the package exports the function

    work = tmp_path / "work"
    real = build_module.tune

    def tune_then_change(*args, **kwargs):
        result = real(*args, **kwargs)
        e = Checkpoint.open(src).entry("layers.0.attn_norm.weight")
        with open(e.path, "r+b") as f:
            f.seek(e.offset)
            b = f.read(1)
            f.seek(e.offset)
            f.write(bytes([b[0] ^ 0x40]))
        return result

    monkeypatch.setattr(build_module, "tune", tune_then_change)
    rows = torch.load(packs / "rows.pt")[:4, :32]
    request = BuildRequest(str(src), tmp_path / "pack", plan=_plan(Checkpoint.open(src).config), calibration_rows=rows,
                           calibration=CalibrationSettings(measure_kl=False), work=work,
                           tune=TuneSettings(steps=1, eval_every=1, batch_rows=4))
    with pytest.raises(UserError, match=r"changed while this build read it \(tune\).*block\(s\) tuned in this run"):
        build(request)
    assert not list((work / "tuned").glob("*.safetensors")) and not (tmp_path / "pack").exists()
