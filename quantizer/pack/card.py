"""The pack's model card (README.md): what a person deciding to download the pack needs, generated
from the manifest and the pack's own headers, so every figure in it is one the pack records.

Hugging Face reads the YAML front matter (base_model + base_model_relation: quantized link the pack to
its source; library_name and tags let it be found: docs/publishing.md). The body states the source and
revision, the loader profile the pack is verified against, bits per tensor class, codebook, head /
drafter / vision policy, calibration, what the pack leaves out, the fit table for 1, 2 and 4 Sparks
(`quantizer fit PACK`'s numbers, computed from the headers against the hardware profile of the day the
card was written: the manifest keeps no verdict), the recorded quality (or "not measured") and the
command that rebuilt it. `verify` checks that README.md is the card of the manifest, so a card that was
edited, or not regenerated after a change of the manifest, is caught; a fit section computed against
an older hardware profile is reported, not a fault (`quantizer card PACK` refreshes it). A card is
written only from claims that match their digest (pack/manifest.py): a hand-edited bpw, measurement or
base model is refused, never stated.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import yaml
from huggingface_hub import ModelCardData

from quantizer.calibrate.storage import HessianRecord
from quantizer.contract.loader_profiles import LoaderProfile
from quantizer.model.tensor_classes import DRAFTER, ENGRAM_TABLE, ROUTED_EXPERT, VISION, classify
from quantizer.pack.fit_table import pack_fit_table
from quantizer.pack.manifest import MANIFEST_NAME, NATIVE, Manifest
from quantizer.pack.measurement import Measurement
from quantizer.report import size_text, table
from quantizer.workdir import write_json_atomic, write_text_atomic

CARD_NAME = "README.md"
SHIPPED_CALIBRATION = "the shipped calibration set (calibration/calibration.jsonl)"


def card_path(pack: Path) -> Path:
    return Path(pack) / CARD_NAME


def write_card(pack: Path, manifest: Manifest | None = None) -> Path:
    """Write (or rewrite) the card of `pack` from its manifest (read from the pack, where none is given,
    and refused unless its claims check), atomically."""
    if manifest is None:
        manifest = _vouched(pack)
    path = card_path(pack)
    write_text_atomic(path, render_card(manifest, pack_fit_table(pack)))
    return path


def record_measurement(pack: Path, measurement: Measurement) -> Manifest:
    """Set the manifest's `measurement` (and the digest that covers it), nothing else, replaced atomically,
    then regenerate the card from it. A manifest whose claims do not check is refused: recording would
    vouch for a hand edit."""
    manifest = replace(_vouched(pack), measurement=measurement)
    write_json_atomic(Path(pack) / MANIFEST_NAME, manifest.to_dict())
    write_card(pack, manifest)
    return manifest


def _vouched(pack: Path) -> Manifest:
    manifest = Manifest.load(pack)
    manifest.require_claims(Path(pack) / MANIFEST_NAME)
    return manifest


def card_data(m: Manifest) -> ModelCardData:
    """The Hugging Face metadata: base_model (and its relation) only when the source is a known repo; the
    library_name and tags the pack's profile gives its engine (configs/loaders/, `card`)."""
    card = m.profile.card
    base = m.source.get("base_model")
    return ModelCardData(
        base_model=base or None, base_model_relation="quantized" if base else None,
        library_name=card.library_name, pipeline_tag="text-generation",
        license=m.source.get("license") or None,
        tags=list(dict.fromkeys(["exl3", m.profile.name, *card.tags, "quantizer", m.source["arch"]])),
    )


FIT_HEADING = "## Fit on DGX Sparks"


def render_card(m: Manifest, fit: dict | None) -> str:
    """The card's text: a function of the manifest and the pack's fit table (pack/fit_table.py;
    verify compares README.md with it)."""
    source_classes = {classify(name).cls for name in m.sources}
    sections = [
        f"---\n{card_data(m).to_yaml()}\n---",
        _title(m),
        _source(m),
        _loads_in(m),
        _run_it(m),
        _bits(m),
        _policies(m, source_classes),
        _calibration(m),
        _left_out(m, source_classes),
        _fit(fit),
        _quality(m),
        _rebuild(m),
    ]
    return "\n\n".join(sections) + "\n"


def _title(m: Manifest) -> str:
    model = (m.source.get("base_model") or m.source["arch"]).rsplit("/", 1)[-1]
    return (f"# {model} EXL3 {m.quantization['bpw']:g} bpw\n\nAn EXL3 quantization of "
            f"{m.source.get('base_model') or 'a local ' + m.source['arch'] + ' checkpoint'} at "
            f"{m.quantization['bpw']:g} bits per weight (exllamav3 accounting), written by quantizer {m.tool['version']}.")


def _source(m: Manifest) -> str:
    s = m.source
    lines = ["## Source", "",
             f"- model: `{s.get('base_model') or s['path']}` ({s['arch']})",
             f"- revision: {'`' + s['revision'] + '`' if s.get('revision') else 'none recorded (a local checkpoint)'}",
             f"- content fingerprint: `{s['fingerprint']}` (`quantizer ppl PACK --against SRC` checks it)"]
    return "\n".join(lines)


def _loads_in(m: Manifest) -> str:
    profile = m.profile
    encoded = f"exllamav3 {m.tool['exllamav3']} on a GPU" if m.tool.get("exllamav3") else "quantizer's CPU codec"
    features = ", ".join(m.loader_features) or "none beyond stock EXL3"
    return "\n".join([
        "## Loads in", "",
        f"- loader profile `{profile.name}`: {profile.engine}; `quantizer verify PACK` checks every stored "
        "linear against its rules",
        f"- EXL3 format of exllamav3 {m.tool['exllamav3_target']}; encoded by {encoded}; "
        f"quantizer {m.tool['version']}, torch {m.tool['torch']}",
        f"- loader features required: {features}",
        *([f"- not read by this engine (written for other tools): {', '.join(profile.ignored)}"] if profile.ignored else []),
    ])


RUN_HEADING = "## Run it"


def _run_it(m: Manifest) -> str:
    """How to start the pack in its profile's engine: the engine, the command, the settings. Commands are
    the ones docs/loader-profiles.md gives (with the engine document it cites); where it gives none, the
    card says what the engine reads and where its launcher is. A function of the manifest alone (the fit
    table is not: its verdicts follow today's hardware profile)."""
    given = _flag_value(m.tool.get("command") or [], "--sparks")
    return "\n".join([RUN_HEADING, "", *RUN_SECTIONS[m.profile.card.run](m, m.profile, given)])


def _sparks_text(profile: LoaderProfile, given: str | None) -> str:
    if given:
        return f"{given} DGX Spark{'s' if given != '1' else ''} (the build's `--sparks {given}`)"
    counts = [str(n) for n in profile.sparks]
    listed = ", ".join(counts[:-1]) + " or " + counts[-1] if len(counts) > 1 else counts[0]
    return f"{listed} DGX Sparks (the fit table below says where this pack fits)"


def _run_vllm(m: Manifest, profile: LoaderProfile, given: str | None) -> list[str]:
    mixed = _mixed_k_layers(m)
    env = "VLLM_EXL3_TENSOR_MIXED_K=1 " if mixed else ""
    tp = given or "N"
    return [
        "Engine: vLLM with the vllm-exl3 plugin (vcruz305/vllm-exl3) in the plugin's DeepSeek-V4.1 vLLM image, on "
        f"{_sparks_text(profile, given) if given else 'N DGX Sparks'}, one tensor-parallel rank per Spark with expert "
        "parallelism. From the folder that holds this pack:",
        *_fenced(f'{env}vllm serve "$PWD" --quantization exl3 --tokenizer-mode deepseek_v41 --tensor-parallel-size {tp} '
                 f"--enable-expert-parallel{' --enforce-eager' if mixed else ''}"),
        *([] if given else [f"- N: the Spark count, {_sparks_text(profile, None)}; no vllm-exl3 pack of V4.1-Flash, "
                            "which stores every routed expert, fits one (docs/loader-profiles.md of quantizer)"]),
        (f"- routed experts of one layer differ in K in {len(mixed)} layer(s), so the plugin's per-expert path is on: "
         "`VLLM_EXL3_TENSOR_MIXED_K=1`, `--enforce-eager`, expert parallel, no speculative decoding" if mixed else
         "- every layer's routed experts share one K (config.json's `layer_bits`), so the per-expert path "
         "(`VLLM_EXL3_TENSOR_MIXED_K=1`) is not needed"),
        "- context: vLLM takes config.json's `max_position_embeddings` unless `--max-model-len` caps it; the fit table "
        "below gives the most that fits per Spark count",
        "- the command is the plugin's launch shape (its docs/DEEPSEEK_V41_TP4_EP4.md: pin the image digest and the "
        "plugin commit) with the run-time settings of docs/loader-profiles.md (vllm-exl3) of quantizer",
    ]


def _run_tensorfold(m: Manifest, profile: LoaderProfile, given: str | None) -> list[str]:
    engram = m.plan.get("engram_dir") or {"dir": "<pack>-Engram", "shards": []}  # absent: a manifest edited by hand
    return [
        f"Engine: TensorFold's DeepSeek-V4.1 engine (bertholomus/TensorFold, Zig kit) on {_sparks_text(profile, given)}; "
        "it has no one-Spark path. It reads the model from this folder and the Engram tables from a folder of their "
        f"own: `quantizer build` wrote `{engram['dir']}/` beside the pack, {len(engram['shards'])} source shard(s) "
        f"({', '.join(engram['shards'])}) linked from the source. It is not uploaded with the pack: elsewhere, put "
        "those shards of the source in such a folder. Point TensorFold at it before its launcher starts:",
        *_fenced(f'export TF_DS_ENGRAM="$PWD/../{engram["dir"]}"'),
        "- or pass `--engram DIR`; TensorFold's READMEs also find a folder next to the model whose name contains "
        "`Engram` (docs/loader-profiles.md of quantizer, tensorfold)",
        "- the launch itself is the TensorFold recipes' two- or four-node lane; quantizer's docs give no command of "
        "their own for it",
    ]


def _run_exllamav3(m: Manifest, profile: LoaderProfile, given: str | None) -> list[str]:
    version = m.tool["exllamav3_target"]
    v41 = m.source["arch"] == "v41"
    return [
        f"Engine: stock exllamav3 {version} (turboderp-org/exllamav3, `pip install exllamav3=={version}`) on one GPU "
        "host: one Spark, its tensor parallelism being single-host. It loads this folder as a model directory, as "
        "quantizer's GPU tests load every pack of this profile (tests/gpu/test_pack_exllamav3.py), run from here:",
        *_fenced("from exllamav3 import Config, Model", 'model = Model.from_config(Config.from_directory("."))',
                 "model.load()", language="python"),
        *([f"- exllamav3 {version} has no DeepSeek-V4.1 architecture: this V4.1 pack is for forks that share its "
           "kernels (docs/loader-profiles.md of quantizer, exllamav3)"] if v41 else []),
        "- context: the fit table below gives the most that fits on one Spark",
    ]


def _run_one_spark(m: Manifest, profile: LoaderProfile, given: str | None) -> list[str]:
    """Native ExLlamaV3's V4.1 loader serves weights from the mapped file as the pack's launch.env says."""
    launch = m.plan["launch"]
    cold = (f"{launch['cold_experts']:,} cold routed experts ({launch['cold_share']:.2%} of the calibration's routed "
            "tokens) are left in the page cache with the drafter" if launch["cold_experts"] else
            "every routed expert is copied into GPU memory, the drafter left in the page cache")
    drafter = ("" if launch.get("drafter", True) else " The drafter is in source form, which the engine would "
               "dequantize into GPU memory, so it launches without it (`DRAFT=0`); build with `--overlay` for an "
               "EXL3 drafter served from the mapped file.")
    return [
        "Engine: native ExLlamaV3's V4.1 loader (vcruz305/exllamav3, branch `feat/gb10-ats-load`; the recipe pins "
        "commit `954a8ca6e59d`) on one DGX Spark in ATS addressing mode. `launch.env` in this folder sets what the "
        f"engine copies into GPU memory and what it serves from the mapped shards (`EXL3_ATS_MMAP=1`, `EXL3_ATS_COPY`, "
        f"`DRAFT`): {cold}.{drafter} Load it before the recipe's launcher (vcruz305/DeepSeek-V4.1-Flash-EXL3-DGX-Spark-"
        "recipe, `one-spark-tp1/scripts/run_tp1.sh`, which keeps variables already set):",
        *_fenced("set -a; . ./launch.env; set +a", "MODEL_DIR=$PWD one-spark-tp1/scripts/run_tp1.sh"),
        (f"- context: `launch.env` sets `CTX={launch['context']}` and `CHUNK={launch['chunk']}`, what the pack was "
         "fitted for (the launcher's own default is 6,144 tokens); the fit table below gives the most that fits on "
         "one Spark" if launch.get("context") else
         "- context: the fit table below gives the most that fits on one Spark (docs/gb10-memory.md of quantizer, "
         "one Spark); set `CTX` (a multiple of 256) before the launcher, whose default is 6,144 tokens"),
    ]


# The profile's `card.run` names the writer of its launch shape (contract/loader_profiles.RUN_SECTIONS).
RUN_SECTIONS = {"exllamav3": _run_exllamav3, "vllm": _run_vllm, "tensorfold": _run_tensorfold, "mapped": _run_one_spark}


def _fenced(*lines: str, language: str = "") -> list[str]:
    """A command block of the card, and the blank line after it."""
    return ["", f"```{language}", *lines, "```", ""]


def _mixed_k_layers(m: Manifest) -> list[int]:
    """The layers whose routed experts hold more than one K (vllm-exl3 reads them on its per-expert path)."""
    ks: dict[int, set] = {}
    for name, t in m.tensors.items():
        if t.cls == ROUTED_EXPERT and name.endswith(".trellis"):
            ks.setdefault(classify(name).layer, set()).add(t.K)
    return sorted(layer for layer, k in ks.items() if len(k) > 1)


def _flag_value(command: list[str], flag: str) -> str | None:
    """The value of `flag` in a recorded command line (`--flag V` or `--flag=V`), or None."""
    for i, word in enumerate(command):
        if word == flag and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def bits_text(m: Manifest) -> str:
    """The pack's bits in words: per weight of which tensors, and how exllamav3's record rounds them."""
    q = m.quantization
    groups = m.profile.budgeted_groups
    which = "the routed experts" if groups == ("routed",) else f"the budgeted tensors ({', '.join(groups)})"
    rounded = "" if q["bits"] == q["bpw"] else f"; exllamav3's record (quantization_config.json) rounds it to bits {q['bits']}"
    return f"{q['bpw']:g} bits per weight over {which}{rounded}; codebook {m.plan['codebook']}"


def _bits(m: Manifest) -> str:
    q = m.quantization
    rows = [[cls, f"{t['tensors']:,}", size_text(t["bytes"]), f"{t['params']:,}",
             "" if t["bpw"] is None else f"{t['bpw']:.3f}"] for cls, t in m.totals.items()]
    hist = ", ".join(f"K {k}: {n:,}" for k, n in q["k_histogram"].items()) or "none"
    return "\n".join([
        "## Bits", "",
        f"{bits_text(m)}. EXL3 linears by K, the bits per weight each stores (16 = fp16): {hist}.", "",
        "Stored bits per source parameter, by tensor class:", "",
        "```", table(["class", "tensors", "bytes", "params", "bpw"], rows), "```",
    ])


def _policies(m: Manifest, source_classes: set[str]) -> str:
    head = m.plan["head_bits"]
    return "\n".join([
        "## Head, drafter, vision", "",
        f"- head: {'kept at 16 bits (native or fp16)' if head == 16 else f'EXL3 K {head:g}'}",
        f"- DSpark drafter: {_class_policy(m, DRAFTER, source_classes)}",
        f"- vision tower: {_class_policy(m, VISION, source_classes)}",
    ])


def _class_policy(m: Manifest, cls: str, source_classes: set[str]) -> str:
    if cls not in m.totals:
        return "not in the pack" if cls in source_classes else "the source has none"
    ks = sorted({str(t.K) for t in m.tensors.values() if t.cls == cls})
    if ks == [NATIVE]:
        return "passed through as the source stores it"
    return f"{m.totals[cls]['bpw']:.3f} bpw (K {', '.join(k for k in ks if k != NATIVE)})"


def _calibration(m: Manifest) -> str:
    record = m.settings.get("calibration")
    if not record:
        return "## Calibration\n\nnone: the linears were quantized without Hessians."
    hessians = HessianRecord.from_dict(record, f"{MANIFEST_NAME} settings")
    return (f"## Calibration\n\n{hessians.rows:,} rows x {hessians.cols:,} tokens of {_calibration_text(m)}; "
            f"Hessians fingerprint `{hessians.fingerprint}`.{_tuning(m)}")


def _tuning(m: Manifest) -> str:
    """Sentences on the tune stages (build --tune, --tune-e2e), or nothing when the pack's scales are the encoder's."""
    out = ""
    t = m.settings.get("tuning")
    if t:
        ratios = list(t["heldout_error_ratio"].values())
        mean = sum(ratios) / len(ratios) if ratios else 1.0
        out += (f"\n\nTuned (`build --tune`): each block's EXL3 `suh`/`svh` fitted to the native block's outputs "
                f"({t['inputs']} inputs) on {t['tune_rows']:,} of these rows, up to {t['steps']} Adam steps at lr "
                f"{t['lr']:g}, early-stopped on the other {t['heldout_rows']:,}; held-out block-output error x{mean:.3f} "
                "on average.")
    e = m.settings.get("end_to_end")
    if e:
        out += (f"\n\nTuned end to end (`build --tune-e2e`): every EXL3 `suh`/`svh` of the trunk and head fitted to "
                f"the native model's next-token distributions on {e['tune_rows']:,} of these rows, {e['steps_run']} Adam "
                f"steps at lr {e['lr']:g}; held-out KL {e['heldout_kl_before']:.4g} -> {e['heldout_kl_after']:.4g} on the "
                f"other {e['heldout_rows']:,}.")
    return out + ("" if not out else " Codes, sizes and every native tensor are as without tuning.")


def _calibration_text(m: Manifest) -> str:
    command = m.tool.get("command") or []
    for flag in ("--text", "--tokens"):
        value = _flag_value(command, flag)
        if value:
            return f"`{Path(value).name}` ({flag})"
    return SHIPPED_CALIBRATION if command else "the text given to the build (no command recorded)"


def _left_out(m: Manifest, source_classes: set[str]) -> str:
    missing = sorted(source_classes - set(m.totals))
    engram = [s.file for s in m.shards if s.engram]
    lines = ["## Not in the pack", ""]
    if engram:
        lines.append(f"- Engram tables are in the pack ({len(engram)} shard(s): {', '.join(engram)}), "
                     "byte-identical to the source's")
    for cls in missing:
        hint = ("copy the source's Engram shards into a directory and give it to the engine as its Engram "
                "directory" if cls == ENGRAM_TABLE else "take it from the source checkpoint")
        lines.append(f"- {cls}: not stored; {hint}")
    if not missing:
        lines.append("- nothing: every tensor of the source is in the pack, as stored or as the EXL3 linears "
                     "that replace it" + (" (cold experts served by aliases)" if m.aliases else ""))
    return "\n".join(lines)


def without_fit(card: str) -> str:
    """The card with its fit section left out (what stays true when the hardware profile changes)."""
    head, found, rest = card.partition(FIT_HEADING)
    after = rest.find("\n## ")
    return head + (rest[after:] if after >= 0 else "") if found else card


def _fit(f: dict | None) -> str:
    if not f:
        return f"{FIT_HEADING}\n\nnot computed."
    rows = []
    for sparks, engines in f["topologies"].items():
        for engine, r in engines.items():
            mapped = r.get("mapped_gib") or [0.0] * len(r["weights_gib"])
            d = r.get("decode")
            rows.append([sparks, engine, "yes" if r["fits"] else "no",
                         " / ".join(f"{w:,.3f}" + (f" (+{g:,.3f} mapped)" if g else "")
                                    for w, g in zip(r["weights_gib"], mapped)),
                         " / ".join(f"{g:,.3f}" for g in r["free_gib"]), f"{r['max_context']:,}",
                         _decode_cell(d)])
    return "\n".join([
        FIT_HEADING, "",
        f"At {f['context']:,} tokens x {f['streams']} stream(s), split {f['split']}, Engram {f['engram']}, "
        f"drafter {f['drafter']}, vision {f['vision']}, hardware profile {f['hardware']} "
        "(`quantizer fit PACK --sparks N` prints the same per-rank numbers):", "",
        "```", table(["Sparks", "engine", "fits", "weights GiB per rank", "free GiB per rank", "max context",
                      "decode tok/s (model)"], rows),
        "```", "",
        "Decode tok/s is a model, not a measurement (quantizer's docs/decode-speed.md): the bytes a token reads over "
        "GB10's bandwidth and the engine's kernel launches by the dispatch path each layer's expert layout takes, "
        "its constants fitted to published rates; with the drafter in brackets.",
    ])


def _decode_cell(d: dict | None) -> str:
    if not d:
        return "-"
    drafter = f" ({d['with_drafter']:.1f})" if d.get("with_drafter") else ""
    return f"{d['tokens_per_second']:.1f}{drafter}"


def _quality(m: Manifest) -> str:
    q = m.measurement
    if q is None:
        return ("## Quality\n\nnot measured. `quantizer ppl PACK --against SRC --text FILE --record` measures it "
                "against the source and records it here.")
    rows = [
        ["KL(source || pack), nats/token", f"{q.kl:.5f} ± {q.kl_stderr:.5f}"],
        ["top-1 agreement", f"{q.top1:.2%} ± {q.top1_stderr:.2%}"],
        ["perplexity, pack", f"{q.ppl:.4f}"],
        ["perplexity, source", f"{q.ppl_source:.4f}"],
        ["NLL delta (pack - source), nats/token", f"{q.nll_delta:+.5f} ± {q.nll_delta_stderr:.5f}"],
    ]
    e = q.engine
    return "\n".join([
        "## Quality", "",
        f"Measured on {q.tokens:,} predicted tokens ({q.rows} rows x {q.cols} tokens) of `{q.text}` "
        f"(sha256 `{q.text_sha256}`); logits by {e.name} {e.version} on {e.device} in {e.dtype}; "
        "± one standard error, tokens taken as independent:", "",
        "```", table(["measure", "value"], rows), "```",
    ])


def source_license(root: Path) -> str | None:
    """The `license` of the source's own model card front matter (Hugging Face repositories have one)."""
    path = Path(root) / CARD_NAME
    text = path.read_text(errors="replace") if path.is_file() else ""
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return None
    try:
        meta = yaml.safe_load(text[4: text.index("\n---", 4)])
    except yaml.YAMLError:
        return None
    license_ = meta.get("license") if isinstance(meta, dict) else None
    return str(license_) if license_ else None


def _rebuild(m: Manifest) -> str:
    command = m.tool.get("command")
    how = f"```\n{shlex.join(command)}\n```" if command else "not recorded."
    return (f"## Rebuild\n\n{how}\n\nThe plan's content hash is `{m.plan['hash']}`; the build resumes from its "
            "work directory when interrupted.")
