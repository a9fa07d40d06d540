"""`quantizer eval`: an lm-eval task (a local JSONL multiple-choice task) on a pack of the bundled small
model and on the model itself, on the CPU, with the paired differences; the lm_eval model class scores
what our perplexity code computes for the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")  # the `eval` extra; the dev extra installs it

from lm_eval.api.instance import Instance  # noqa: E402

from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.cli import main  # noqa: E402
from quantizer.errors import UserError  # noqa: E402
from quantizer.evaluate.harness import ForwardLM  # noqa: E402
from quantizer.evaluate.paired import paired_scores  # noqa: E402
from quantizer.model.streaming import LayerStreamer  # noqa: E402
from quantizer.model.targets import targets  # noqa: E402
from quantizer.plan.plan import make_plan  # noqa: E402
from quantizer.ppl.perplexity import row_predictions  # noqa: E402
from quantizer.ppl.pack_source import PackSource  # noqa: E402
from quantizer.shipped import shipped  # noqa: E402

TASK = "python_continuations"
DATA = Path(__file__).parent / "fixtures" / "eval" / f"{TASK}.jsonl"
QUANTIZED = ("layers.2.ffn.experts.", "layers.3.ffn.experts.")  # 48 routed-expert linears at K 2


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    src = shipped("small_model")
    cfg = Checkpoint.open(src).config
    make_plan(cfg, {t.key: (2.0 if t.key.startswith(QUANTIZED) else None) for t in targets(cfg)}).save(root / "plan.json")
    assert main(["build", str(src), "--plan", str(root / "plan.json"), "--out", str(root / "pack"), "--no-calibrate"]) == 0
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(DATA))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n")
    return {"src": src, "pack": root / "pack", "tasks": tasks}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_eval_prints_source_and_pack_scores_with_paired_differences(built, capsys):
    assert main(["eval", str(built["pack"]), "--against", str(built["src"]), "--tasks", TASK,
                 "--include-path", str(built["tasks"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["task", "metric", "documents", "source", "pack", "pack", "-", "source", "(paired)"]
    [row] = [line.split() for line in out[2:]]
    task, metric, documents, source, pack, delta, _, stderr = row
    assert (task, metric, documents) == (TASK, "acc", "12")
    assert float(source) >= 8 / 12  # the trained model rejects the eight nonsense continuations
    assert float(delta) == pytest.approx(float(pack) - float(source), abs=1e-4)  # a mean of differences
    assert float(stderr) >= 0


def test_paired_differences_are_taken_document_by_document():
    source = {0: {"acc": 1.0}, 1: {"acc": 0.0}, 2: {"acc": 1.0}, 3: {"acc": 1.0}}
    pack = {0: {"acc": 1.0}, 1: {"acc": 1.0}, 2: {"acc": 0.0}, 3: {"acc": 0.0}}
    [s] = paired_scores("t", source, pack)
    assert (s.documents, s.source, s.pack, s.delta) == (4, 0.75, 0.5, -0.25)
    diff = torch.tensor([0.0, 1.0, -1.0, -1.0])
    assert s.delta_stderr == pytest.approx(float(diff.std(unbiased=True)) / 2)
    with pytest.raises(UserError, match="different documents"):
        paired_scores("t", source, {0: {"acc": 1.0}})


def test_the_model_class_scores_what_the_perplexity_code_computes(built):
    """loglikelihood(context, continuation) and the rolling loglikelihood of a text are sums of the
    per-token NLLs that quantizer.ppl computes for the same [BOS] + tokens row."""
    pack = str(built["pack"])
    lm = ForwardLM(pack)
    streamer = LayerStreamer(PackSource(Checkpoint.open(pack)), progress=False)
    context, continuation = "def __init__(self", ", name):\n        self.name = name\n"
    ctx, cont = lm._encode(context), lm._encode(continuation)
    row = torch.tensor([[lm.bos] + ctx + cont])
    nll = next(row_predictions(streamer, row)).nll()
    [(logprob, _)] = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    assert logprob == pytest.approx(-float(nll[-len(cont):].sum()), rel=1e-5)
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (context + continuation,), 0)])
    whole = lm._encode(context + continuation)
    row = torch.tensor([[lm.bos] + whole])
    nll = next(row_predictions(streamer, row)).nll()
    assert rolling == pytest.approx(-float(nll.sum()), rel=1e-5)


def test_generation_tasks_and_unknown_tasks_are_refused_in_one_line(built, capsys):
    with pytest.raises(UserError, match="generation tasks need an engine with a KV cache"):
        ForwardLM(str(built["src"])).generate_until([Instance("generate_until", {}, ("x", {}), 0)])
    assert main(["eval", str(built["pack"]), "--tasks", "no_such_task_xyz", "--include-path", str(built["tasks"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no_such_task_xyz" in err[0]


def test_a_pack_is_compared_only_with_its_own_source(built, tiny_v41, capsys):
    assert main(["eval", str(built["pack"]), "--against", str(tiny_v41), "--tasks", TASK,
                 "--include-path", str(built["tasks"])]) == 2
    assert "compare a pack with its own source" in capsys.readouterr().err
