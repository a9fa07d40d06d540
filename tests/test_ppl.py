"""`quantizer ppl` on the tiny V4.1 checkpoint: numbers equal the whole model's own NLL; `--text`
takes a shipped set by name; the pass over the rows has a bar of its own."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from quantizer.checkpoint.safetensors_file import planned, write_safetensors
from quantizer.checkpoint.source import Checkpoint
from quantizer.cli import main
from quantizer.model.transformer import DeepseekModel
from quantizer.shipped import shipped
from quantizer.textdata import shipped_text_path


@pytest.fixture(scope="module")
def rows():
    return torch.from_numpy(np.random.default_rng(0).integers(3, 4096, size=(3, 48)))


def test_ppl_json_matches_the_whole_model(tiny_v41, rows, tmp_path, capsys):
    path = tmp_path / "rows.npy"
    np.save(path, rows.numpy())
    assert main(["ppl", str(tiny_v41), "--tokens", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"ppl", "nll", "nll_stderr", "tokens"}

    model = DeepseekModel.from_checkpoint(Checkpoint.open(tiny_v41))
    with torch.no_grad():
        logits = model(rows)
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, rows[:, 1:, None])[..., 0].double().flatten()
    assert result["tokens"] == nll.numel() == 3 * 47
    assert result["nll"] == pytest.approx(float(nll.mean()), abs=1e-5)
    assert result["nll_stderr"] == pytest.approx(float(nll.std()) / math.sqrt(nll.numel()), rel=1e-4)
    assert result["ppl"] == pytest.approx(math.exp(result["nll"]), rel=1e-9)


def test_ppl_cuts_a_safetensors_stream_into_rows(tiny_v41, rows, tmp_path, capsys):
    path = tmp_path / "stream.safetensors"
    write_safetensors(path, [planned("input_ids", rows.flatten())])
    assert main(["ppl", str(tiny_v41), "--tokens", str(path), "--cols", "40", "--rows", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 2 * 39


def test_ppl_text_without_tokenizer_is_a_user_error(tiny_v41, tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    assert main(["ppl", str(tiny_v41), "--text", str(text)]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_ppl_text_takes_a_shipped_set_by_name(capsys):
    """`--text heldout-tests` measures on the shipped test-suite set: the numbers of its file, not heldout's
    (on the bundled small model, which carries the shipped tokenizer)."""
    model = shipped("small_model")

    def ppl(text: str) -> dict:
        assert main(["ppl", str(model), "--text", text, "--rows", "2", "--cols", "40", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    by_name = ppl("heldout-tests")
    assert by_name == ppl(str(shipped_text_path("heldout-tests")))
    assert by_name["tokens"] == 2 * 39 and by_name != ppl("heldout")

    assert main(["ppl", str(model), "--text", "heldout-test"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["quantizer ppl: error: heldout-test: no such file, and not a shipped text set (train, calibration, "
                   "heldout, heldout-tests); check the path or the set name"]


def test_ppl_counts_rows_after_the_layers_with_one_bar_when_comparing(tiny_v41, rows, tmp_path, capsys):
    """Past the bar over layers, the head's pass over the rows has a bar of its own (rows done of all); with
    --against the two models advance row by row together, so one bar counts them."""
    path = tmp_path / "rows.npy"
    np.save(path, rows.numpy())
    for against, layer_passes in (([], 1), (["--against", str(tiny_v41)], 2)):
        assert main(["ppl", str(tiny_v41), "--tokens", str(path), "--json", *against]) == 0
        err = capsys.readouterr().err
        assert err.count("layers:   0%") == layer_passes and err.count("rows:   0%") == 1
        assert err.index("rows:   0%") > err.rindex("layers: 100%") and "| 3/3 [" in err[err.index("rows:"):]
