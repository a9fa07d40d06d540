"""`quantizer eval`: an lm-eval task (a local JSONL multiple-choice task) on a pack of the bundled small
model and on the model itself, on the CPU, with the paired differences; the lm_eval model class scores
what our perplexity code computes for the same tokens. A pack with a flipped byte or an edited manifest
is refused before it is scored (as `ppl` refuses it), numeric flags below 1 are refused while the
arguments are read, and a task whose dataset the hub cannot give (unreachable, offline, gated,
unauthorised) is one line: the hub is simulated by raising what `datasets` and huggingface_hub raise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from one_line import one_line

lm_eval = pytest.importorskip("lm_eval")  # the `eval` extra; the dev extra installs it

import datasets  # noqa: E402
import httpx2  # noqa: E402
import huggingface_hub  # noqa: E402
from datasets.exceptions import DatasetNotFoundError  # noqa: E402
from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled  # noqa: E402
from huggingface_hub.utils import hf_raise_for_status  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.cli import build_parser, main  # noqa: E402
from quantizer.contract.rules import make_plan  # noqa: E402
from quantizer.errors import UserError  # noqa: E402
from quantizer.evaluate.harness import ForwardLM  # noqa: E402
from quantizer.evaluate.paired import paired_scores  # noqa: E402
from quantizer.model.streaming import LayerStreamer  # noqa: E402
from quantizer.model.targets import targets  # noqa: E402
from quantizer.ppl.pack_source import PackSource  # noqa: E402
from quantizer.ppl.perplexity import row_predictions  # noqa: E402
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
    return {"src": src, "pack": root / "pack", "tasks": write_task(root / "tasks")}


def write_task(tasks: Path) -> Path:
    """A directory holding the local multiple-choice task TASK (12 documents of tests/fixtures/eval/)."""
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(DATA))}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n")
    return tasks


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_eval_prints_source_and_pack_scores_with_paired_differences(built, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no git repository: lm-eval's git probe once printed "fatal: ..." (issue 60)
    assert main(["eval", str(built["pack"]), "--against", str(built["src"]), "--tasks", TASK,
                 "--include-path", str(built["tasks"])]) == 0
    out, err = capfd.readouterr()
    assert "fatal" not in err
    out = out.splitlines()
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



def _files(pack) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(pack.iterdir())}


@pytest.mark.parametrize("against", [False, True])
def test_a_pack_with_a_flipped_byte_is_refused_before_it_is_scored(built, tmp_path, capsys, against):
    pack = shutil.copytree(built["pack"], tmp_path / "pack")
    shard = sorted(pack.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    before = _files(pack)
    assert main(["eval", str(pack), "--tasks", TASK, "--include-path", str(built["tasks"]),
                 *(["--against", str(built["src"])] if against else [])]) == 2
    one_line(capsys.readouterr().err, f"{shard}: sha256", "is not the manifest's", "verify --full")
    assert _files(pack) == before


def test_a_pack_whose_manifest_was_edited_is_refused_before_it_is_scored(built, tmp_path, capsys):
    pack = shutil.copytree(built["pack"], tmp_path / "pack")
    manifest = json.loads((pack / "manifest.json").read_text())
    manifest["quantization"]["bpw"] = 4.0
    (pack / "manifest.json").write_text(json.dumps(manifest))
    assert main(["eval", str(pack), "--tasks", TASK, "--include-path", str(built["tasks"])]) == 2
    one_line(capsys.readouterr().err, "manifest.json: was edited after packing")


def test_a_pack_whose_tokenizer_was_edited_is_refused_before_it_is_scored(built, tmp_path, capsys):
    """The tokenizer cuts the text the pack is scored on: verify faulted an edited one while eval scored with it
    (issue 60)."""
    pack = shutil.copytree(built["pack"], tmp_path / "pack")
    tokenizer = pack / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"def"', '"fed"', 1))
    before = _files(pack)
    assert main(["eval", str(pack), "--tasks", TASK, "--include-path", str(built["tasks"])]) == 2
    one_line(capsys.readouterr().err, f"{tokenizer}: not the file the pack stage wrote", "verify --full")
    assert _files(pack) == before


@pytest.mark.parametrize("flag, value", [("--limit", "0"), ("--limit", "-5"), ("--limit", "ten"), ("--max-length", "0"),
                                         ("--max-length", "-1")])
def test_counts_below_one_are_refused_while_the_arguments_are_read(flag, value, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["eval", "pack", "--tasks", TASK, flag, value])
    assert stop.value.code == 2
    one_line(capsys.readouterr().err, f"argument {flag}: {value!r}: a whole number of at least 1")


def _raised(error: Exception, cause: Exception | None = None):
    """A load_dataset that fails as `datasets` does: `error`, raised from huggingface_hub's `cause`."""
    def load_dataset(*args, **kwargs):
        raise error from cause
    return load_dataset


def _http(status: int) -> Exception:
    response = httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/datasets/allenai/ai2_arc"))
    try:
        hf_raise_for_status(response)
    except Exception as e:  # noqa: BLE001 - the error under test
        return e
    raise AssertionError("no error for this response")


@pytest.mark.parametrize("load_dataset, needles", [
    (_raised(ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub (LocalEntryNotFoundError)"),
             LocalEntryNotFoundError("not cached and the hub is unreachable")),
     ("not in the local Hugging Face cache and the hub cannot be reached", "check the network")),
    (_raised(ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub (OfflineModeIsEnabled)"),
             OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled.")),
     ("huggingface_hub is in offline mode (HF_HUB_OFFLINE is set); unset HF_HUB_OFFLINE",)),
    (_raised(httpx2.ConnectError("[Errno 101] Network is unreachable")),
     ("cannot reach the Hugging Face Hub (ConnectError: [Errno 101] Network is unreachable)",)),
    (_raised(DatasetNotFoundError("Dataset 'allenai/ai2_arc' is a gated dataset on the Hub. You must be "
                                  "authenticated to access it.")),
     ("is a gated dataset on the Hub", "accept its terms on the hub and log in with `hf auth login`")),
    (_raised(_http(401)), ("the hub refused it (HTTP 401)", "HF_TOKEN")),
])
def test_the_readmes_task_with_the_hub_out_of_reach_is_one_line(built, monkeypatch, capsys, load_dataset, needles):
    """`quantizer eval PACK --tasks arc_easy` (the README's example) when its dataset cannot be had."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert main(["eval", str(built["pack"]), "--tasks", "arc_easy", "--limit", "2",
                 "--include-path", str(built["tasks"])]) == 2  # the task index the other tests built
    one_line(capsys.readouterr().err, "error: the dataset of arc_easy: ", *needles)


def test_the_readmes_task_in_offline_mode_says_so(built, monkeypatch, capsys):
    """With HF_HUB_OFFLINE set, `datasets` raises a ConnectionError that keeps only the name of
    huggingface_hub's refusal (raised `from None`, over its own cache miss), as it does here."""
    def load_dataset(*args, **kwargs):
        try:
            raise FileNotFoundError("Dataset allenai/ai2_arc is not cached in None")
        except FileNotFoundError:
            raise ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub (OfflineModeIsEnabled)") from None

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert main(["eval", str(built["pack"]), "--tasks", "arc_easy", "--limit", "2",
                 "--include-path", str(built["tasks"])]) == 2  # the task index the other tests built
    one_line(capsys.readouterr().err, "error: the dataset of arc_easy: huggingface_hub is in offline mode "
              "(HF_HUB_OFFLINE is set); unset HF_HUB_OFFLINE")
