"""`quantizer demo --json` on the bundled model at one size: every pack is verified, the methods spend
the same bytes, and our allocator's pack costs less KL than uniform K at those bytes."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from quantizer.orchestrate.stages import QUANTIZE_DIR
from quantizer.checkpoint.safetensors_file import read_header
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.commands.demo import render
from quantizer.contract.rules import make_plan
from quantizer.demo.sweep import BUILD_DIR, DemoResult, DemoRow, measure_packs
from quantizer.model.targets import targets
from quantizer.pack.manifest import Manifest
from quantizer.ppl.measure import streamer
from quantizer.ppl.perplexity import row_predictions
from quantizer.plots import DPI, save_figure
from quantizer.quantize.results import RESULTS_DIR
from quantizer.shipped import shipped
from quantizer.textdata import shipped_text_path

# The tests of the demo run are slow (it builds packs); its refusals and the V4 model's shape run in test-fast.
KEYS = {"bpw", "method", "achieved_bpw", "bytes", "ppl", "kl", "kl_stderr", "top1", "top1_stderr", "nll_delta",
        "nll_delta_stderr", "loader", "verified", "fits_1_spark", "weights_gib"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One demo run: its JSON rows, and the --plot figure it drew with the PNG it saved."""
    work = tmp_path_factory.mktemp("demo")
    drawn = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("quantizer.commands.demo.save_figure", lambda fig, path: drawn.append(fig) or save_figure(fig, path))
        found = _demo(work, "--plot", str(work / "quality.png"))
    return found, drawn, work / "quality.png"


def _demo(work, *extra) -> list[dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["demo", "--json", "--sizes", "2.5", "--methods", "uniform,ours", "--loader", "exllamav3",
                     "--eval-rows", "4", "--work", str(work), *extra]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def rows(run):
    return {r["method"]: r for r in run[0]}


@pytest.mark.slow
def test_rows_name_every_method_with_size_fit_and_quality(rows):
    assert set(rows) == {"uniform", "ours"}
    for r in rows.values():
        assert set(r) == KEYS and r["bpw"] == 2.5 and r["loader"] == "exllamav3" and r["verified"] and r["fits_1_spark"]
        assert 0 < r["kl"] and 0 < r["top1"] < 1 and r["ppl"] > 1 and r["bytes"] > 0
        assert r["achieved_bpw"] <= 2.5 + 1e-9


@pytest.mark.slow
def test_ours_costs_less_kl_than_uniform_at_equal_bytes(rows):
    ours, uniform = rows["ours"], rows["uniform"]
    assert abs(ours["bytes"] - uniform["bytes"]) <= 0.01 * uniform["bytes"]
    assert ours["kl"] < uniform["kl"]


@pytest.mark.slow
def test_plot_draws_kl_and_top1_with_error_bars_per_method(run):
    json_rows, (fig,), png = run
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == tuple(round(x) for x in fig.get_size_inches() * DPI)
    kl_ax, top_ax = fig.axes
    for ax, key, scale in ((kl_ax, "kl", 1), (top_ax, "top1", 100)):
        curves = {c.get_label(): c for c in ax.containers}
        assert set(curves) == {r["method"] for r in json_rows}  # one curve per method, named from the rows
        for r in json_rows:  # one loader: each curve is one method's row
            line, _, (bars,) = curves[r["method"]]
            assert list(line.get_xdata()) == [r["achieved_bpw"]] and list(line.get_ydata()) == [scale * r[key]]
            (low, high), = [seg[:, 1] for seg in bars.get_segments()]
            assert high - low == pytest.approx(2 * scale * r[key + "_stderr"]) and r[key + "_stderr"] > 0


@pytest.mark.slow
def test_a_demo_row_is_what_quantizer_build_writes(run, rows, tmp_path, capfd, monkeypatch):
    """The demo's packs rebuilt by `quantizer build` in the demo's order (uniform, then ours allocating
    on the errors measured so far), in a work directory holding what the demo's held before its first
    build of ours: its calibration and the uniform pack's encodings. Uniform finds all its units in that
    cache; ours plans on it, and once planned its quantize stage is handed the demo's other encodings (the
    cache is content-keyed: a plan other than the demo's would encode). Both give the demo's shards, and
    ours the demo's KL."""
    demo_work, demo_packs = run[2].parent / BUILD_DIR, run[2].parent / "packs"
    demo_results = demo_work / QUANTIZE_DIR / RESULTS_DIR
    uniform_units = _encodings_of(demo_packs / "2.5-uniform-exllamav3", demo_results)
    assert uniform_units
    src, work = shipped("small_model"), tmp_path / "work"
    shutil.copytree(demo_work, work, ignore=lambda folder, names: [
        n for n in names if Path(folder).name == RESULTS_DIR and n not in uniform_units])
    common = ["build", str(src), "--bpw", "2.5", "--loader", "exllamav3", "--calib-rows", "16", "--calib-cols", "512",
              "--device", "cpu", "--encoder", "fast", "--work", str(work)]
    capfd.readouterr()
    assert main(common + ["--method", "uniform", "--out", str(tmp_path / "uniform")]) == 0
    assert re.findall(r"([\d,]+) weights to encode", capfd.readouterr().err) == ["0"]
    pipeline_build = importlib.import_module("quantizer.orchestrate.stages")  # the module, not its build()
    quantize = pipeline_build.quantize

    def quantize_with_the_demos_encodings(*args, **kwargs):
        for unit in demo_results.glob("*.safetensors"):
            if unit.name not in uniform_units:
                shutil.copy(unit, work / QUANTIZE_DIR / RESULTS_DIR / unit.name)
        return quantize(*args, **kwargs)

    monkeypatch.setattr(pipeline_build, "quantize", quantize_with_the_demos_encodings)
    assert main(common + ["--method", "ours", "--measured-errors", "--out", str(tmp_path / "ours")]) == 0
    assert re.findall(r"([\d,]+) weights to encode", capfd.readouterr().err) == ["0"]
    for method in ("uniform", "ours"):
        assert _shards(tmp_path / method) == _shards(demo_packs / f"2.5-{method}-exllamav3"), method
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ppl", str(tmp_path / "ours"), "--against", str(src), "--text", str(shipped_text_path("heldout")),
                     "--rows", "4", "--cols", "512", "--json"]) == 0
    assert json.loads(out.getvalue())["kl"] == pytest.approx(rows["ours"]["kl"], rel=1e-9)


def _encodings_of(pack: Path, results: Path) -> set[str]:
    """The cache files in `results` that hold the pack's linears at the pack's K (each names its keys and K)."""
    k = Manifest.load(pack).exl3_keys()
    found = set()
    for path in results.glob("*.safetensors"):
        meta = read_header(path).metadata
        if all(key in k and float(k[key]) == float(meta["K"]) for key in json.loads(meta["keys"])):
            found.add(path.name)
    return found


@pytest.mark.slow
def test_a_rerun_in_the_same_work_directory_encodes_nothing_and_prints_the_same_rows(run, capfd):
    capfd.readouterr()
    assert _demo(run[2].parent) == run[0]
    encoded = re.findall(r"([\d,]+) weights to encode", capfd.readouterr().err)
    assert encoded and set(encoded) == {"0"}  # every build found all its units in the cache


@pytest.mark.slow
def test_eval_text_measures_the_same_packs_on_another_text(run, rows, capfd):
    """`--eval-text heldout-tests` in the same work directory: the same packs (nothing encoded, the same
    bytes), measured on the second held-out set, as `quantizer ppl --text heldout-tests` measures them."""
    capfd.readouterr()
    other = {r["method"]: r for r in _demo(run[2].parent, "--eval-text", "heldout-tests")}
    assert set(re.findall(r"([\d,]+) weights to encode", capfd.readouterr().err)) == {"0"}
    for method, r in other.items():
        assert r["bytes"] == rows[method]["bytes"] and r["kl"] != rows[method]["kl"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ppl", str(run[2].parent / "packs" / "2.5-ours-exllamav3"), "--against", str(shipped("small_model")),
                     "--text", "heldout-tests", "--rows", "4", "--cols", "512", "--json"]) == 0
    assert json.loads(out.getvalue())["kl"] == pytest.approx(other["ours"]["kl"], rel=1e-9)


@pytest.mark.slow
def test_a_tensorfold_row_is_measured_with_the_engram_directory_beside_its_pack(run, rows):
    """Ours for tensorfold in the same work directory (the calibration and uniform's encodings reused):
    every linear EXL3 at the same budget, the Engram tables read from the directory beside the pack, and
    the row's KL the one `quantizer ppl` measures on that pack."""
    folded = {r["method"]: r for r in _demo(run[2].parent, "--loader", "tensorfold")}
    assert folded["uniform"] == rows["uniform"]  # the same reference pack, rebuilt from the cache
    ours = folded["ours"]
    assert ours["loader"] == "tensorfold" and ours["verified"] and 0 < ours["kl"] and 0 < ours["top1"] < 1
    assert ours["achieved_bpw"] <= 2.5 + 1e-9
    pack = run[2].parent / "packs" / "2.5-ours-tensorfold"
    assert (pack.parent / (pack.name + "-Engram")).is_dir()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ppl", str(pack), "--against", str(shipped("small_model")), "--text", "heldout", "--rows", "4",
                     "--cols", "512", "--json"]) == 0
    assert json.loads(out.getvalue())["kl"] == pytest.approx(ours["kl"], rel=1e-9)


def _shards(pack) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pack.glob("*.safetensors"))}


def test_the_table_says_a_tensorfold_row_needs_more_than_one_spark():
    """A tensorfold pack has no 1-Spark weights (its engine runs on 2 or 4): the table says so, where
    formatting the missing figure crashed `make demo` once."""
    def row(loader, weights_gib):
        return DemoRow(bpw=2.5, method="ours", loader=loader, achieved_bpw=2.49, bytes=1000, ppl=9.0, kl=0.1,
                       kl_stderr=0.01, top1=0.9, top1_stderr=0.01, nll_delta=0.05, nll_delta_stderr=0.01,
                       verified=True, fits_1_spark=weights_gib is not None, weights_gib=weights_gib)
    text = render(DemoResult(rows=[row("exllamav3", 0.123), row("tensorfold", None)], native_ppl=8.5, tokens=2048,
                             seconds=1.0, eval_text="heldout"))
    lines = [line for line in text.splitlines() if "ours" in line]
    assert "0.123 GiB, fits" in lines[0] and "engine needs 2+" in lines[1]


def test_the_demo_says_which_pack_of_how_many_it_measures(tiny_v41, tmp_path, capsys):
    """The final measuring is a loop of silent forwards: each pack is named as "pack k of N" before its
    forward, under a bar over the packs (two copies of one instant fp16 pack of the tiny model)."""
    cfg = Checkpoint.open(tiny_v41).config
    plan = make_plan(cfg, {t.key: (16.0 if t.key.startswith("layers.0.attn.") else None) for t in targets(cfg)})
    plan.save(tmp_path / "plan.json")
    assert main(["build", str(tiny_v41), "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "pack"),
                 "--no-calibrate"]) == 0
    held = torch.from_numpy(np.random.default_rng(5).integers(3, 4096, size=(2, 16)))
    reference = list(row_predictions(streamer(Checkpoint.open(tiny_v41), quiet=True), held))
    capsys.readouterr()
    compared = measure_packs(reference, [tmp_path / "pack", tmp_path / "pack"], held)
    err = capsys.readouterr().err
    assert [c.tokens for c in compared] == [2 * 15, 2 * 15] and compared[0] == compared[1]
    assert re.findall(r"demo: measuring pack (\d+) of (\d+): (\S+)", err) == [("1", "2", "pack"), ("2", "2", "pack")]
    assert err.index("measuring pack 2 of 2") > err.index("| 1/2 [") and "| 2/2 [" in err


def test_measured_errors_need_our_allocator(capsys):
    assert main(["build", str(shipped("small_model")), "--bpw", "2.5", "--method", "uniform", "--measured-errors",
                 "--out", "never-written"]) == 2
    assert "--measured-errors feeds our allocator; it needs --method ours" in capsys.readouterr().err


def test_unknown_method_and_empty_evaluation_are_user_errors(capsys):
    assert main(["demo", "--methods", "uniform,best"]) == 2
    assert "unknown method(s) best" in capsys.readouterr().err
    assert main(["demo", "--eval-rows", "0"]) == 2
    assert "--eval-rows 0: rows must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--loader", "vllm"]) == 2
    assert "loader(s) vllm not in the demo; choose from exllamav3, vllm-exl3, tensorfold" in capsys.readouterr().err
    assert main(["demo", "--model", "small-v5"]) == 2
    assert "unknown --model 'small-v5'; choose from small-v41, small-v4" in capsys.readouterr().err
    assert main(["demo", "--eval-text", "heldout-test"]) == 2  # before any build
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "heldout-test: no such file, and not a shipped text set (" in err


def test_bundled_v4_model_is_the_shape_exllamav3_runs():
    # `demo --model small-v4` opens this checkpoint: the shipped config, every tensor its layout implies,
    # and what stock exllamav3 1.6.5 asserts or needs (architecture/deepseek_v4*.py, modules/dsv4.py).
    from quantizer.checkpoint.config import V4
    from quantizer.checkpoint.source import Checkpoint
    from quantizer.demo.sweep import MODELS
    from quantizer.inventory.classify import check_against_config
    from quantizer.shipped import model_config_path, shipped
    from quantizer.textdata import shipped_tokenizer_path

    root = shipped(MODELS["small-v4"])
    ck = Checkpoint.open(root)
    cfg = ck.config
    assert cfg.arch == V4 and cfg.raw == json.loads(model_config_path("small-v4.json").read_text())
    assert not check_against_config(ck)
    assert cfg.raw["num_key_value_heads"] == 1 and cfg.hc_mult == 4 and set(cfg.compress_ratios) == {0, 4, 128}
    assert cfg.num_hash_layers > 0 and cfg.num_mtp_blocks == 3
    dims = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.q_lora_rank, cfg.o_lora_rank, cfg.head_dim,
            cfg.index_head_dim, cfg.dspark_markov_rank)
    assert all(d % 128 == 0 for d in dims), dims
    assert (root / "tokenizer.json").read_bytes() == shipped_tokenizer_path().read_bytes()
    assert json.loads((root / "training.json").read_text())["arch"] == V4
