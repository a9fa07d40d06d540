"""`quantizer ppl PACK --against SRC`: a pack is run with the weights a loader reconstructs, and its
KL, top-1 agreement and paired NLL delta against the source are what two whole forwards give."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.codec import EXL3Linear, dequantize
from quantizer.contract.loader_profiles import EXLLAMAV3, load_profile
from quantizer.contract.rules import make_plan
from quantizer.model.hooks import ForwardHooks
from quantizer.model.targets import targets
from quantizer.model.transformer import DeepseekModel
from quantizer.ppl.compare import compare
from quantizer.ppl.perplexity import RowPredictions

QUANTIZED = ("layers.0.attn.wkv", "layers.1.ffn.experts.2.w2", "layers.2.ffn.shared_experts.w1")
TIED = tuple(f"layers.1.ffn.experts.{e}.w2" for e in range(8))  # exllamav3: one K for a layer's experts


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "rows.npy"
    np.save(path, np.random.default_rng(5).integers(3, 4096, size=(2, 32)))
    return path


def _pack(src, root, k: dict[str, float | None]):
    cfg = Checkpoint.open(src).config
    make_plan(cfg, {t.key: k.get(t.key) for t in targets(cfg)}, profile=load_profile(EXLLAMAV3)).save(root / "plan.json")
    assert main(["build", str(src), "--plan", str(root / "plan.json"), "--out", str(root / "pack"),
                 "--no-calibrate"]) == 0
    return root / "pack"


@pytest.fixture(scope="module")
def quantized_pack(tiny_v41, tmp_path_factory):
    return _pack(tiny_v41, tmp_path_factory.mktemp("q"), {key: 2.0 for key in QUANTIZED + TIED})


def _against(pack, src, rows_file, capsys) -> dict:
    capsys.readouterr()  # drop what the build printed
    assert main(["ppl", str(pack), "--against", str(src), "--tokens", str(rows_file), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_pack_of_native_tensors_costs_nothing(tiny_v41, rows_file, tmp_path, capsys):
    pack = _pack(tiny_v41, tmp_path, {})
    r = _against(pack, tiny_v41, rows_file, capsys)
    assert r["kl"] == pytest.approx(0.0, abs=1e-6) and r["top1"] == 1.0
    assert r["nll_delta"] == pytest.approx(0.0, abs=1e-6) and r["ppl"] == pytest.approx(r["ppl_source"], rel=1e-6)
    assert r["tokens"] == 2 * 31


def test_kl_and_deltas_equal_two_whole_forwards(tiny_v41, quantized_pack, rows_file, capsys):
    r = _against(quantized_pack, tiny_v41, rows_file, capsys)
    pack = Checkpoint.open(quantized_pack)
    decoded = {}
    for key in QUANTIZED + TIED:
        leaves = {n: pack.raw(n) for n in pack.tensors if n.startswith(key + ".")}
        decoded[key + ".weight"] = dequantize(EXL3Linear.from_tensors(leaves, key))
    model = DeepseekModel.from_checkpoint(Checkpoint.open(tiny_v41))
    rows = torch.from_numpy(np.load(rows_file))
    with torch.no_grad():
        native = torch.log_softmax(model(rows)[:, :-1].float(), -1)
        hooks = ForwardHooks(weight_override=lambda name, _w: decoded.get(name))
        packed = torch.log_softmax(model(rows, hooks=hooks)[:, :-1].float(), -1)
    target = rows[:, 1:, None]
    kl = (native.exp() * (native - packed)).sum(-1)
    delta = (native.gather(-1, target) - packed.gather(-1, target))[..., 0]
    assert r["kl"] == pytest.approx(float(kl.mean()), rel=1e-3) and r["kl"] > 0
    assert r["nll_delta"] == pytest.approx(float(delta.mean()), rel=1e-3, abs=1e-6)
    assert r["top1"] == pytest.approx(float((native.argmax(-1) == packed.argmax(-1)).double().mean()))
    assert r["kl_stderr"] == pytest.approx(float(kl.double().std()) / math.sqrt(kl.numel()), rel=1e-3)
    assert r["kl_p95"] == pytest.approx(float(np.percentile(kl.double().numpy(), 95)), rel=1e-3)
    assert r["kl_p95"] > r["kl"] and r["ppl_ratio"] == pytest.approx(math.exp(float(delta.double().mean())), rel=1e-5)


def test_the_text_receipt_states_the_kl_p95_and_the_perplexity_ratio(tiny_v41, quantized_pack, rows_file, capsys):
    r = _against(quantized_pack, tiny_v41, rows_file, capsys)
    assert main(["ppl", str(quantized_pack), "--against", str(tiny_v41), "--tokens", str(rows_file)]) == 0
    line = capsys.readouterr().out.strip()
    assert f"(source {r['ppl_source']:.4f}, ratio {r['ppl_ratio']:.4f})" in line, line
    assert f"KL {r['kl']:.5f} ± {r['kl_stderr']:.5f} (p95 {r['kl_p95']:.5f})" in line, line


def test_kl_p95_and_ppl_ratio_are_numpys_over_the_same_tokens():
    """Two rows of unequal length: the percentile runs over every token of both, not per row or over row means."""
    rng = np.random.default_rng(3)
    logits = {who: [rng.normal(scale=2.0, size=(n, 11)) for n in (9, 4)] for who in ("source", "pack")}
    targets_ = [rng.integers(0, 11, size=n) for n in (9, 4)]

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    def predictions(who):
        return [RowPredictions(i, torch.from_numpy(log_softmax(x)), torch.from_numpy(t))
                for i, (x, t) in enumerate(zip(logits[who], targets_))]

    c = compare(predictions("source"), predictions("pack"))
    ref = np.concatenate([log_softmax(x) for x in logits["source"]])
    test = np.concatenate([log_softmax(x) for x in logits["pack"]])
    target = np.concatenate(targets_)
    kl = (np.exp(ref) * (ref - test)).sum(-1)
    nll_ref, nll_test = -ref[np.arange(13), target], -test[np.arange(13), target]
    assert c.tokens == 13 and c.kl == pytest.approx(kl.mean(), rel=1e-9)
    assert c.kl_p95 == pytest.approx(np.percentile(kl, 95), rel=1e-9) and c.kl < c.kl_p95 < kl.max()
    assert c.ppl_ratio == pytest.approx(np.exp(nll_test.mean()) / np.exp(nll_ref.mean()), rel=1e-9)
    assert c.as_dict()["kl_p95"] == c.kl_p95 and c.as_dict()["ppl_ratio"] == c.ppl_ratio


def test_compare_pairs_rows_and_refuses_unequal_counts():
    g = torch.Generator().manual_seed(0)
    rows = [RowPredictions(i, torch.log_softmax(torch.randn(5, 7, generator=g), -1), torch.arange(5) % 7)
            for i in range(2)]
    same = compare(rows, rows)
    assert same.kl == 0 and same.top1 == 1 and same.nll_delta == 0 and same.tokens == 10
    with pytest.raises(ValueError):
        compare(rows, rows[:1])


def test_bad_inputs_exit_2(tiny_v41, rows_file, tmp_path, capsys):
    assert main(["ppl", str(tiny_v41), "--against", str(tmp_path / "missing"), "--tokens", str(rows_file)]) == 2
    assert "missing" in capsys.readouterr().err
