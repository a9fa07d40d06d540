"""The card's "Run it" is a runbook a newcomer can paste (issue 61): for every shipped profile it installs the
engine, downloads the pack, joins the Sparks where the engine spans several, launches with the context and
streams the pack was built for and says what "started" looks like. Every command line in it comes from a step of
the profile's `card.runbook` (or the card's own download step), each step naming the public file it was read from
(repository, path, commit). A fifth profile without a runbook still gets a card that says its launch is unknown,
and a profile whose runbook breaks these rules is one line, not a traceback."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import pytest
from one_line import one_line

from quantizer import caches
from quantizer.cli import main
from quantizer.contract.loader_profiles import EXTRA_PROFILES, RUN_STEPS, load_profile, loader_names
from quantizer.contract.rules import make_plan
from quantizer.checkpoint.source import Checkpoint
from quantizer.model.targets import targets
from quantizer.pack.card import DOWNLOAD, RUN_HEADING, render_card
from quantizer.pack.manifest import Manifest
from quantizer.shipped import shipped

SHIPPED = ("exllamav3", "vllm-exl3", "tensorfold", "exllamav3-v41")
SOURCE = re.compile(r"(?:^|, )[\w.-]+/[\w.-]+ \S+ @[0-9a-f]{7,40}|(?:^|, )\S+ @[0-9a-f]{7,40}")
ENGRAM = {"dir": "pack-Engram", "shards": ["model-00002-of-00003.safetensors"], "tables": 4}


@pytest.fixture(scope="module")
def built(tiny_v41, tmp_path_factory):
    """A small pack built with a planned context and streams (one EXL3 linear: a second of the CPU codec)."""
    root = tmp_path_factory.mktemp("runbook")
    cfg = Checkpoint.open(tiny_v41).config
    make_plan(cfg, {t.key: (2.0 if t.key == "layers.0.attn.wq_b" else None) for t in targets(cfg)}).save(root / "plan.json")
    assert main(["build", str(tiny_v41), "--plan", str(root / "plan.json"), "--out", str(root / "pack"),
                 "--no-calibrate"]) == 0
    return Manifest.load(root / "pack")


def _as(m: Manifest, loader: str, *flags: str, **plan) -> Manifest:
    """The built manifest as a pack of `loader` records it, with `flags` added to its build command: the card is a
    function of the manifest (tests/test_card.py renders each profile's the same way)."""
    extra = {"tensorfold": {"engram_dir": ENGRAM},
             "exllamav3-v41": {"launch": {"file": "launch.env", "cold_experts": 0, "cold_share": 0.0, "drafter": True,
                                          "context": 65536, "chunk": 2048}}}
    return replace(m, plan={**m.plan, "loader": loader, **extra.get(loader, {}), **plan},
                   tool={**m.tool, "command": [*m.tool["command"], *flags]})


def _name(m: Manifest) -> str:
    """The folder the runbook downloads the pack into: named as the card's title names the pack."""
    return f"{m.source['arch']}-EXL3-{m.quantization['bpw']:g}bpw"


def _run(card: str) -> str:
    return card[card.index(RUN_HEADING + "\n"): card.index("\n## ", card.index(RUN_HEADING) + 1)]


def _commands(run: str) -> list[str]:
    """Every line inside a fenced block of the run section."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```$", run, re.MULTILINE | re.DOTALL)
    return [line for block in blocks for line in block.splitlines()]


def _pattern(template: str) -> re.Pattern:
    """A step's command line with each `{{key}}` standing for any value."""
    return re.compile("".join(".+?" if part.startswith("{{") else re.escape(part)
                              for part in re.split(r"(\{\{\w+\}\})", template)))


def _sourced(loader: str) -> list[re.Pattern]:
    steps = [*load_profile(loader).card.runbook, DOWNLOAD]
    return [_pattern(c) for s in steps for c in s.commands]


@pytest.mark.parametrize("loader", SHIPPED)
@pytest.mark.parametrize("sparks", [None, "2", "4", "1"])
def test_every_command_of_the_run_section_comes_from_a_sourced_step_of_the_profile(built, loader, sparks):
    profile = load_profile(loader)
    if sparks and int(sparks) not in profile.sparks:
        pytest.skip(f"{loader} does not run on {sparks} Spark(s)")
    flags = ("--context", "131072", "--streams", "2") + (("--sparks", sparks) if sparks else ())
    run = _run(render_card(_as(built, loader, *flags), None))
    commands = _commands(run)
    assert commands, run
    patterns = _sourced(loader)
    for line in commands:
        assert "{{" not in line and any(p.fullmatch(line) for p in patterns), f"{loader}: no sourced step says {line!r}"
    for step in profile.card.runbook:
        assert step.step in RUN_STEPS and SOURCE.match(step.source), step
        assert all(SOURCE.match(part) for part in re.split(r"(?=, [\w./-]+ @)", step.source)), step.source
    assert DOWNLOAD.source.startswith("huggingface/huggingface_hub ")
    assert f"hf download ORG/NAME --revision REV --local-dir $HOME/models/{_name(built)}" in commands
    kinds = {s.step for s in profile.card.runbook if not s.sparks or not sparks or int(sparks) in s.sparks}
    if not kinds:  # a Spark count the engine's sources document no launch for: said, not made up
        assert f"none for {sparks}. The pack itself downloads as below." in run and len(commands) == 1
    else:  # install, launch and what "started" looks like
        assert {"install", "launch", "started"} <= kinds


@pytest.mark.parametrize("loader, planned", [
    ("exllamav3", "cache = Cache(model, max_num_tokens=262144, max_batch_size=2)"),
    ("vllm-exl3", "VLLM_ENGRAM_DISK_BACKED=1 MAX_MODEL_LEN=131072 MAX_NUM_SEQS=2 EAGER=1 DSPARK=0 bash "
                  "scripts/serve.sh 2"),
    ("tensorfold", "--context 131072 --parallel 2 --backend cuda"),
])
def test_the_launch_carries_the_context_and_streams_the_pack_was_built_for(built, loader, planned):
    run = _run(render_card(_as(built, loader, "--context", "131072", "--streams", "2", "--sparks",
                               "1" if loader == "exllamav3" else "2"), None))
    assert any(planned in line for line in _commands(run)), run
    assert "131,072 tokens x 2 stream(s), what the build fitted the pack for" in run


def test_the_one_spark_runbook_launches_from_launch_env_with_its_context(built):
    run = _run(render_card(_as(built, "exllamav3-v41", "--sparks", "1"), None))
    commands = _commands(run)
    assert commands.index(f'cd "$HOME/models/{_name(built)}"') < commands.index("set -a; . ./launch.env; set +a") < \
        commands.index("MODEL_DIR=$PWD $HOME/dsv41-recipe/one-spark-tp1/scripts/run_tp1.sh")
    assert "git -C $HOME/dsv41-recipe checkout 147124bf4d5022c2437faa77906810b54572eeee" in commands  # the recipe
    assert "git checkout 954a8ca6e59d" in " ".join(commands)  # the engine at the recipe's pin
    assert "`CTX=65536`" in run and "ctx=65536" in run  # launch.env's context, and what the driver prints


def test_multi_spark_engines_say_how_the_sparks_join_for_each_count(built):
    vllm = _run(render_card(_as(built, "vllm-exl3", "--sparks", "4"), None))
    assert "NODE_IP=<this-spark-ip> bash scripts/start_disk_engram_cluster.sh worker" in _commands(vllm)
    assert "bash scripts/preflight.sh 4" in _commands(vllm)
    tf = _run(render_card(_as(built, "tensorfold"), None))  # no --sparks: one runbook per Spark count
    assert "### On 2 DGX Sparks" in tf and "### On 4 DGX Sparks" in tf
    two, four = tf.split("### On 4 DGX Sparks")
    assert "scripts/serve.sh start" in _commands(four) and "scripts/serve.sh start" not in _commands(two)
    assert any(" 1 2 <HEAD_IP> 29620 " in line for line in _commands(two))  # rank 1 joins rank 0's rendezvous
    assert any("--engram $HOME/models/pack-Engram" in line for line in _commands(two))


def test_a_context_the_build_did_not_record_as_a_number_is_a_named_placeholder(built):
    run = _run(render_card(_as(built, "vllm-exl3", "--context", "128K"), None))
    assert any("MAX_MODEL_LEN=CTX " in line for line in _commands(run))
    assert "- CTX: the context per stream" in run
    assert "### On 2 DGX Sparks" in run and "bash scripts/serve.sh 4" in run  # no --sparks: each count the recipe runs


@pytest.fixture
def fifth(tmp_path, monkeypatch):
    """A fifth profile, vllm-exl3's rules under another name, registered through $QUANTIZER_LOADERS."""
    def register(**card):
        data = json.loads(shipped("configs", "loaders", "vllm-exl3.json").read_text())
        data.update(name="spark-serve", order=9, default_for=[], demo=False,
                    card={"library_name": None, "tags": [], "run": "vllm", **card})
        folder = tmp_path / "loaders"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        (folder / "spark-serve.json").write_text(json.dumps(data))
        monkeypatch.setenv(EXTRA_PROFILES, str(folder))
        caches.reset()
    yield register
    caches.reset()


def test_a_fifth_profile_without_a_runbook_renders_and_says_its_launch_is_unknown(built, fifth):
    fifth()
    assert loader_names()[-1] == "spark-serve"
    run = _run(render_card(_as(built, "spark-serve"), None))
    assert "quantizer knows no launch for `spark-serve`: its profile names no runbook" in run
    assert _commands(run) == [f"hf download ORG/NAME --revision REV --local-dir $HOME/models/{_name(built)}"]


@pytest.mark.parametrize("step, needle", [
    ({"step": "launch", "say": "x", "commands": ["serve"], "source": "some/where"}, "names a repository, a path and a commit"),
    ({"step": "deploy", "say": "x", "source": "a/b c.py @0123abc"}, "step must be one of"),
    ({"step": "launch", "say": "x", "commands": ["serve {{port}}"], "source": "a/b c.py @0123abc"}, "unknown {{key}}"),
])
def test_a_runbook_step_without_a_source_or_with_an_unknown_key_is_one_line(fifth, capsys, step, needle):
    fifth(runbook=[step])
    assert main(["plan", "--model-config", "small-v41", "--bpw", "2", "--loader", "vllm-exl3"]) == 2
    one_line(capsys.readouterr().err, "spark-serve.json: not a loader profile", needle)
