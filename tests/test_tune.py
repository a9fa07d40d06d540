"""The tune stages (`build --tune`, `--tune-e2e`): the factorisation they train through, that they lower
the held-out block-output error and KL, that the pack they feed differs from an untuned one only in EXL3
suh/svh, still verifies and measures what the stage measured, that a killed run resumes from its
finished blocks, and what bad input gets."""

from __future__ import annotations

import importlib
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from quantizer.orchestrate.stages import QUANTIZE_DIR, BuildRequest, build, plan_and_state, plan_files
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.safetensors_file import PAD_PREFIX, read_bytes, read_header
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.codec import dequantize, quantize_linear
from quantizer.contract.plan import Plan
from quantizer.contract.rules import make_plan
from quantizer.errors import UserError
from quantizer.model.hooks import ForwardHooks, ScaledCodes
from quantizer.model.linear import NativeLinear
from quantizer.model.streaming import CheckpointSource, LayerStreamer
from quantizer.model.targets import targets
from quantizer.pack.manifest import Manifest
from quantizer.ppl.pack_source import PackSource
from quantizer.shipped import model_config_path
from quantizer.tune import end_to_end, stage
from quantizer.tune.factor import factor
from quantizer.tune.settings import EndToEndSettings, TuneSettings
from quantizer.tune.store import TunedStore, finished, run_record

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
                            calibration_settings=CalibrationSettings(measure_kl=False), work=root / "work", tune=tune)

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
    doubled = ScaledCodes(f.codes, q.suh.float() * 2, q.svh.float() * 3).weight()  # linear, on their own axes
    torch.testing.assert_close(doubled, 6 * expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("grouped", [False, True])
def test_scaled_codes_act_on_activations_as_the_weight_they_stand_for(grouped):
    """What tuning differentiates: a linear given scaled codes computes what its built weight computes,
    and the scales get the gradients they would get through that weight (wo_a: one suh per row block)."""
    gen = torch.Generator().manual_seed(1)
    groups, rows_per, cols = (4, 8, 16) if grouped else (1, 24, 16)
    codes = torch.randn(groups * rows_per, cols, generator=gen)
    suh0 = torch.rand(groups, cols, generator=gen) + 0.5 if grouped else torch.rand(cols, generator=gen) + 0.5
    svh0 = torch.rand(groups * rows_per, generator=gen) + 0.5
    x = torch.randn(3, 5, groups, cols, generator=gen) if grouped else torch.randn(3, 5, cols, generator=gen)
    linear = NativeLinear(cols, groups * rows_per, "w.weight")
    outputs, grads = [], []
    for as_codes in (True, False):
        suh, svh = suh0.clone().requires_grad_(), svh0.clone().requires_grad_()
        scaled = ScaledCodes(codes, suh, svh)
        hooks = (ForwardHooks(scaled_codes=lambda name, s=scaled: s) if as_codes
                 else ForwardHooks(weight_override=lambda name, w, s=scaled: s.weight()))
        y = linear.grouped(x, hooks) if grouped else linear(x, hooks)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        outputs.append(y.detach())
        grads.append((suh.grad, svh.grad))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


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


def _tensors(pack) -> dict:
    return {n: e for p in sorted(pack.glob("*.safetensors")) for n, e in read_header(p).tensors.items()
            if not n.startswith(PAD_PREFIX)}


def test_the_tuned_pack_verifies_and_differs_only_in_exl3_scales(packs):
    assert main(["verify", "--full", str(packs / "tuned")]) == 0
    plain, tuned = _tensors(packs / "plain"), _tensors(packs / "tuned")
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
    plan = Plan.load(plan_files(packs / "work", packs / "tuned")[0])
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
    build_module = importlib.import_module("quantizer.orchestrate.stages")  # the package exports the function

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
                           calibration_settings=CalibrationSettings(measure_kl=False), work=work,
                           tune=TuneSettings(steps=1, eval_every=1, batch_rows=4))
    with pytest.raises(UserError, match=r"changed while this build read it \(tune\).*block\(s\) tuned in this run"):
        build(request)
    assert not list((work / "tuned").glob("*.safetensors")) and not (tmp_path / "pack").exists()


# ---- end-to-end tuning (build --tune-e2e) ----------------------------------------------------------

E2E = EndToEndSettings(steps=4, lr=1e-2, eval_every=2, patience=3, batch_rows=4)


@pytest.fixture(scope="module")
def e2e_pack(packs, tiny_v41):
    """Block-wise, then end to end, in the work directory of `packs` (the same codes; the blocks reused)."""
    rows = torch.load(packs / "rows.pt")
    result = build(BuildRequest(str(tiny_v41), packs / "e2e", plan=_plan(Checkpoint.open(tiny_v41).config),
                                calibration_rows=rows, calibration_settings=CalibrationSettings(measure_kl=False),
                                work=packs / "work", tune=SETTINGS, end_to_end=E2E))
    assert result.tuned.tuned == 0  # the block files of `packs`
    return result


def _kl_all_tokens(pack, native, rows) -> float:
    """Mean KL(native || pack) over every position of `rows`, as the stage measures it."""
    def logits(ck):
        return torch.stack(list(LayerStreamer(ck, progress=False, report=lambda line: None).row_logits(rows)))
    ref, got = torch.log_softmax(logits(CheckpointSource(native)), -1), torch.log_softmax(logits(PackSource(pack)), -1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def test_end_to_end_lowers_the_held_out_kl_and_the_pack_measures_what_the_stage_measured(e2e_pack, packs, tiny_v41):
    e = e2e_pack.end_to_end
    assert e.tuned and e.steps == E2E.steps and 0 < e.best_step
    # a real improvement over the block-wise scales it started from: 0.988x on one 2-core host, 0.991x with
    # 2 rows a step, where another host's floating point gave more than 1%; the margin leaves room for that
    assert e.kl_after < 0.995 * e.kl_before
    held = torch.load(packs / "rows.pt")[e.tune_rows:]
    assert len(held) == e.heldout_rows == 4
    # the pack holds the stage's best scales (over the block-wise ones): its forward, decoded as any reader
    # decodes it, has the KL the stage kept, and the untuned pack has the stage's starting KL's order
    measured = _kl_all_tokens(Checkpoint.open(e2e_pack.out), Checkpoint.open(tiny_v41), held)
    assert measured == pytest.approx(e.kl_after, rel=2e-3)
    tuned_blocks = _kl_all_tokens(Checkpoint.open(packs / "tuned"), Checkpoint.open(tiny_v41), held)
    assert tuned_blocks == pytest.approx(e.kl_before, rel=2e-3)
    record = Manifest.load(e2e_pack.out).settings["end_to_end"]
    assert record["heldout_kl_after"] == round(e.kl_after, 6) and record["lr"] == E2E.lr
    assert "Tuned end to end (`build --tune-e2e`)" in (e2e_pack.out / "README.md").read_text()


def test_the_end_to_end_pack_verifies_and_differs_from_the_block_tuned_one_only_in_exl3_scales(e2e_pack, packs):
    assert main(["verify", "--full", str(e2e_pack.out)]) == 0
    before, after = _tensors(packs / "tuned"), _tensors(e2e_pack.out)
    assert before.keys() == after.keys()
    changed = {n for n, e in before.items() if read_bytes(after[n]) != read_bytes(e)}
    assert changed and all(n.endswith((".suh", ".svh")) for n in changed), sorted(changed)[:5]
    exl3 = {n[: -len(".trellis")] for n in before if n.endswith(".trellis")}
    assert {n.rsplit(".", 1)[0] for n in changed} <= exl3


def test_end_to_end_is_reused_by_a_rerun(e2e_pack, packs, tiny_v41):
    ck = Checkpoint.open(tiny_v41)
    job = dict(Manifest.load(packs / "plain").settings)
    block_files = tuple(sorted((packs / "work" / "tuned").glob("layers.*.safetensors")))
    again = end_to_end.end_to_end(ck, Plan.load(plan_files(packs / "work", packs / "tuned")[0]), packs / "work" / QUANTIZE_DIR,
                                  packs / "work", torch.load(packs / "rows.pt"), E2E, job, block_files,
                                  say=lambda line: None)
    assert not again.tuned and again.file == e2e_pack.end_to_end.file and again.kl_after == e2e_pack.end_to_end.kl_after


@pytest.mark.parametrize("flag, instead", [("--tune-e2e", "--tune (block-wise)"), ("--tune", "drop --tune")])
def test_tuning_that_does_not_fit_is_refused_before_any_stage(flag, instead, tiny_v41, tmp_path, capsys, monkeypatch):
    """A tuning stage runs after calibration and quantize: a build whose memory cannot hold it is refused
    before those, naming the GiB it needs (the real V4.1 needs 175+ GiB of RAM block-wise)."""
    monkeypatch.setattr(stage, "free_memory", lambda device: 2**20)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(3, 200, size=(4, 32)))
    code = main(["build", str(tiny_v41), "--bpw", "2.5", "--method", "uniform", "--tokens", str(ids), flag,
                 "--out", str(tmp_path / "pack"), "--work", str(tmp_path / "work")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and f"error: {flag} holds" in err[-1] and "GiB" in err[-1] and instead in err[-1], err
    assert not (tmp_path / "work").exists() and not (tmp_path / "pack").exists()


@pytest.mark.parametrize("flag", ["--tune-e2e", "--tune"])
def test_too_few_calibration_rows_to_tune_are_refused_before_any_stage(flag, tiny_v41, tmp_path, capsys, monkeypatch):
    """One row leaves none to hold out: refused before calibration and quantize, not after them."""
    build_module = importlib.import_module("quantizer.orchestrate.stages")
    monkeypatch.setattr(build_module, "calibrate", lambda *a, **k: pytest.fail("calibrated before refusing"))
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(3, 200, size=(1, 32)))
    code = main(["build", str(tiny_v41), "--bpw", "2.5", "--method", "uniform", "--tokens", str(ids), flag,
                 "--out", str(tmp_path / "pack"), "--work", str(tmp_path / "work")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].endswith(f"error: {flag} needs at least 2 calibration rows (one to tune on, one held "
                                          "out); got 1"), err
    assert "Traceback" not in "\n".join(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.npy"]


def test_a_rerun_of_a_finished_tuned_build_needs_none_of_the_tuning_memory(e2e_pack, packs, tiny_v41, tmp_path,
                                                                           monkeypatch):
    """The up-front check guards stages still to run: a rerun whose tuning finished (its pack lost, or
    wanted again) reuses the tuned files on a machine that could not tune now; changed settings are
    still refused before any stage, and a tuned file gone since is tuned again, checked by the stage."""
    monkeypatch.setattr(stage, "free_memory", lambda device: 2**20)
    plan, rows = _plan(Checkpoint.open(tiny_v41).config), torch.load(packs / "rows.pt")

    def request(out: Path, work: Path, tune: TuneSettings) -> BuildRequest:
        return BuildRequest(str(tiny_v41), out, plan=plan, calibration_rows=rows,
                            calibration_settings=CalibrationSettings(measure_kl=False), work=work, tune=tune, end_to_end=E2E)

    again = build(request(tmp_path / "again", packs / "work", SETTINGS))
    assert again.tuned.tuned == 0 and not again.end_to_end.tuned
    assert again.manifest.settings["end_to_end"] == e2e_pack.manifest.settings["end_to_end"]
    with pytest.raises(UserError, match="--tune holds"):
        build(request(tmp_path / "changed", packs / "work", replace(SETTINGS, steps=SETTINGS.steps + 1)))
    assert not (tmp_path / "changed").exists()

    work = tmp_path / "work"
    shutil.copytree(packs / "work", work)
    next(work.glob("tuned/layers.1.*.safetensors")).unlink()
    with pytest.raises(UserError, match="--tune holds"):
        build(request(tmp_path / "lost", work, SETTINGS))
    assert not (tmp_path / "lost").exists()


def test_only_a_readable_matching_record_counts_as_a_finished_stage(tmp_path):
    """A missing, truncated or other run's record means the memory check runs; asking writes nothing."""
    record = run_record(SETTINGS.record(), "abc")
    assert not finished(tmp_path / "work", stage.STAGE, record) and not (tmp_path / "work").exists()
    TunedStore(tmp_path).mark_finished(stage.STAGE, record)
    assert finished(tmp_path, stage.STAGE, record)
    assert not finished(tmp_path, end_to_end.STAGE, record)
    assert not finished(tmp_path, stage.STAGE, run_record(SETTINGS.record(), "abd"))
    done = next((tmp_path / "tuned").glob("*.done.json"))
    done.write_text(done.read_text()[:10])
    assert not finished(tmp_path, stage.STAGE, record)


@pytest.mark.parametrize("argv, message", [
    (["--no-calibrate", "--tune-e2e"], "--no-calibrate"),
    (["--tune-e2e-steps", "3"], "add --tune-e2e"),
])
def test_bad_end_to_end_requests_are_refused_in_one_line(argv, message, tiny_v41, tmp_path, capsys):
    code = main(["build", str(tiny_v41), "--bpw", "2.5", "--method", "uniform", *argv, "--out", str(tmp_path / "pack")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "pack").exists()


def test_end_to_end_settings_refuse_what_cannot_run():
    with pytest.raises(UserError, match="at least 1"):
        EndToEndSettings(steps=0)
    with pytest.raises(UserError, match="held-out share"):
        EndToEndSettings(heldout=1.0)
    with pytest.raises(UserError, match="at least 2 calibration rows"):
        EndToEndSettings().split(1)


def test_the_stage_keeps_only_the_rows_its_steps_and_held_out_measurements_use():
    """A real build's 250 calibration rows: 20 steps of 2 rows draw from 40, and 16 are held out; the rest
    are never held, so they cost no memory (tune_memory) and a real block fits one GPU beside them."""
    settings = TuneSettings()
    assert settings.split(250) == (40, 16)
    assert settings.split(16) == (12, 4)  # fewer rows than the steps can draw: the shares as before
    assert TuneSettings(steps=5, batch_rows=1, heldout_rows=2).split(100) == (5, 2)
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    assert stage.tune_memory(cfg, 250, 2048, settings) == stage.tune_memory(cfg, 1000, 2048, settings)
    assert stage.tune_memory(cfg, 250, 2048, settings) < 0.9 * 139 * 2**30  # one H200 (bench/tune_block_gpu.py)
    with pytest.raises(UserError, match="held-out rows"):
        TuneSettings(heldout_rows=0)


def test_plan_and_build_state_the_tune_stages_hours(tiny_v41, capsys):
    """`plan` states what --tune adds at the build's default calibration; `build --tune` states it for its rows
    and its GPUs, which the stage holds while it runs on one (docs/tuning.md, cost at real scale)."""
    assert main(["plan", "--model-config", "deepseek-v4.1-flash", "--bpw", "2.9", "--loader", "exllamav3"]) == 0
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    hours = stage.tune_seconds(cfg, 250, 2048, TuneSettings()) / 3600
    assert 0.25 < hours < 0.5  # bench/tune_block_gpu.py: 32.4 s a full-size block, every step paid, on one H200
    assert re.search(rf"^tune \(--tune\): at most {hours:.2f} h on one H200 at measured rates \(40 blocks, "
                     rf"20 steps each on 56 of 250 rows x 2048\).* {hours:.2f} on 1 GPU, {8 * hours:.2f} on 8 GPUs$",
                     capsys.readouterr().out, re.M)
    longer = TuneSettings(steps=40)
    assert stage.tune_seconds(cfg, 250, 2048, longer) > stage.tune_seconds(cfg, 250, 2048, TuneSettings())
    ck = Checkpoint.open(tiny_v41)
    req = BuildRequest(str(tiny_v41), None, plan=_plan(ck.config), calibration_rows=torch.zeros(16, 64, dtype=torch.long),
                       tune=SETTINGS)
    plan_and_state(ck.config, req, None, ranks=2)
    assert stage.tune_line(ck.config, 16, 64, SETTINGS, (2,)) in capsys.readouterr().err
