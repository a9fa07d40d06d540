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
from quantizer.contract.loader_profiles import LoaderProfile, RunStep
from quantizer.fit.launch import launch_context
from quantizer.fit.render import context_note
from quantizer.model.tensor_classes import DRAFTER, ENGRAM_TABLE, ROUTED_EXPERT, VISION, classify
from quantizer.pack.fit_table import pack_fit_table
from quantizer.pack.manifest import K_MAP_NAME, MANIFEST_NAME, NATIVE, Manifest
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
            f"{m.quantization['bpw']:g} {m.profile.bits_measure}, written by quantizer {m.tool['version']}.")


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
DOWNLOAD = RunStep(
    "download",
    "On each Spark that runs it, at the same path: the pack from the Hugging Face repository it was published to "
    "(`quantizer publish PACK --repo ORG/NAME`), with huggingface_hub's `hf` (`pip install huggingface_hub`). `{{repo}}` and "
    "`{{revision}}` stand for that repository and its branch or commit (`main` without `--revision`): the card is "
    "written before the upload and cannot name them.",
    ("hf download {{repo}} --revision {{revision}} --local-dir $HOME/models/{{name}}",),
    "huggingface/huggingface_hub src/huggingface_hub/cli/download.py @3654dccfdc88")  # huggingface_hub's `hf` CLI


def _run_it(m: Manifest) -> str:
    """How to start the pack in its profile's engine: a runbook from install to the first request, each step read
    from the engine's public code (the profile's `card.runbook`, docs/loader-profiles.md), filled with the context
    and streams the pack was built for; where the profile has none, the card says the launch is not known. A
    function of the manifest alone (the fit table is not: its verdicts follow today's hardware profile)."""
    given = str(m.planned.sparks) if m.planned else _flag_value(m.tool.get("command") or [], "--sparks")
    return "\n".join([RUN_HEADING, "", *RUN_SECTIONS[m.profile.card.run](m, m.profile, given)])


def _sparks_text(profile: LoaderProfile, given: str | None) -> str:
    if given:
        return f"{given} DGX Spark{'s' if given != '1' else ''} (the build's `--sparks {given}`)"
    counts = [str(n) for n in profile.sparks]
    listed = ", ".join(counts[:-1]) + " or " + counts[-1] if len(counts) > 1 else counts[0]
    return f"{listed} DGX Sparks (the fit table below says where this pack fits)"


def _run_values(m: Manifest, given: str | None, context: int | None = None) -> dict[str, str]:
    """What fills a runbook's `{{key}}`s: a folder name for the pack (its title's), the context and streams it
    was fitted to (Manifest.planned, else the build's recorded `--context` and `--streams`), the Spark count and the
    Engram folder."""
    command, planned = m.tool.get("command") or [], m.planned
    recorded = _flag_value(command, "--context") or ""  # a pack built before packs recorded what they were fitted to
    context = context or (planned and planned.context) or (int(recorded) if recorded.isdigit() else None)
    streams = planned.streams if planned else int(_flag_value(command, "--streams") or 1)
    model = (m.source.get("base_model") or m.source["arch"]).rsplit("/", 1)[-1]
    return {"name": f"{model}-EXL3-{m.quantization['bpw']:g}bpw", "repo": "ORG/NAME", "revision": "REV",
            "context": str(context) if context else "CTX", "streams": str(streams),
            "tokens": str(launch_context(context) * streams) if context else "CTX",
            "sparks": given or "N", "engram": (m.plan.get("engram_dir") or {}).get("dir", "")}


def _context_text(values: dict[str, str]) -> str:
    if values["context"] != "CTX":
        return (f"- context: {int(values['context']):,} tokens x {values['streams']} stream(s), what the build fitted the "
                "pack for; the fit table below gives the most that fits")
    return ("- CTX: the context per stream, which the build did not record as a number (it fitted the model's "
            "max positions, config.json's `max_position_embeddings`, or a `--context` such as 128K): put in a token "
            "count; the fit table below gives the most that fits")


def _runbook(profile: LoaderProfile, given: str | None, values: dict[str, str]) -> list[str]:
    """The profile's runbook steps with the pack's download among them, filled with `values`: one pass, or one per
    Spark count where steps differ by topology and the build named none."""
    steps = profile.card.runbook
    if not steps:
        return [f"quantizer knows no launch for `{profile.name}`: its profile names no runbook (`card.runbook` of its "
                "JSON, docs/loader-profiles.md); the engine's own documentation says how it starts and what it "
                "reads. The pack itself downloads as below.", "", *_step(DOWNLOAD, values)]
    ordered = [*(s for s in steps if s.step == "install"), DOWNLOAD, *(s for s in steps if s.step != "install")]
    counts = sorted({n for s in steps for n in s.sparks})
    if given and not any(not s.sparks or int(given) in s.sparks for s in steps):
        return [f"The launch its sources document is for {' or '.join(map(str, counts))} DGX Sparks, none for {given}. "
                "The pack itself downloads as below.", "", *_step(DOWNLOAD, values)]
    if given or not counts:
        return [line for s in ordered if not s.sparks or int(given or 0) in s.sparks for line in _step(s, values)]
    out: list[str] = []
    for n in counts:
        out += [f"### On {n} DGX Sparks", ""]
        out += [line for s in ordered if not s.sparks or n in s.sparks for line in _step(s, values | {"sparks": str(n)})]
    return out


def _step(step: RunStep, values: dict[str, str]) -> list[str]:
    say, source, commands = step.lines(values)
    return [f"**{step.step.capitalize()}.** {say} (from `{source}`)",
            *(_fenced(*commands, language=step.language) if commands else [""])]


def _run_vllm(m: Manifest, profile: LoaderProfile, given: str | None) -> list[str]:
    mixed = _mixed_k_layers(m)
    values = _run_values(m, given)
    return [
        "Engine: vLLM with the vllm-exl3 plugin (vcruz305/vllm-exl3) on "
        f"{_sparks_text(profile, given)}, one tensor-parallel rank per Spark with expert "
        "parallelism, as the plugin author's DGX-Spark recipe runs it (docs/loader-profiles.md of quantizer, "
        "vllm-exl3).", "",
        *([] if given else ["- no vllm-exl3 pack of V4.1-Flash, which stores every routed expert, fits one Spark; "
                            "the recipe's `serve.sh` takes 2 or 4"]),
        (f"- routed experts of one layer differ in K in {len(mixed)} layer(s): the plugin reads them on its per-expert "
         "path, which `VLLM_EXL3_TENSOR_MIXED_K=1` in the serving container turns on, eager, with expert parallelism "
         "and no speculative decoding (the launch below sets `EAGER=1 DSPARK=0`). The recipe's `serve.sh` forwards "
         "only the variables it lists into the container, and this one is not among them: set it in the containers' "
         "environment as they start (the recipe's cluster script is not in the repository index, so how it takes one "
         "more variable is not confirmed here)" if mixed else
         "- every layer's routed experts share one K (config.json's `layer_bits`), so the per-expert path "
         "(`VLLM_EXL3_TENSOR_MIXED_K=1`) is not needed"),
        _context_text(values), "",
        *_runbook(profile, given, values),
    ]


def _run_tensorfold(m: Manifest, profile: LoaderProfile, given: str | None) -> list[str]:
    engram = m.plan.get("engram_dir") or {"dir": "<pack>-Engram", "shards": []}  # absent: a manifest edited by hand
    values = _run_values(m, given) | {"engram": engram["dir"]}
    return [
        f"Engine: TensorFold's DeepSeek-V4.1 engine (bertholomus/TensorFold, Zig kit) on {_sparks_text(profile, given)}; "
        "it has no one-Spark path, and its config.zig takes only the full-size V4.1-Flash shapes. It reads the model "
        "from the pack's folder and the Engram tables from a folder of their own: `quantizer build` wrote "
        f"`{engram['dir']}/` beside the pack, {len(engram['shards'])} source shard(s) ({', '.join(engram['shards'])}) "
        "linked from the source. It is not uploaded with the pack: beside the download, put those shards of the "
        f"source in `$HOME/models/{engram['dir']}`, which the launch below passes (`--engram`, `TF_DS_ENGRAM`).", "",
        _context_text(values),
        "- `<...>`: the site's own values (addresses, RDMA devices, network interface, folders), as the recipes leave "
        "them", "",
        *_runbook(profile, given, values),
    ]


def _run_exllamav3(m: Manifest, profile: LoaderProfile, given: str | None) -> list[str]:
    version = m.tool["exllamav3_target"]
    values = _run_values(m, given)
    return [
        f"Engine: stock exllamav3 {version} (turboderp-org/exllamav3) on one GPU host: one Spark, its tensor "
        "parallelism being single-host.", "",
        *([f"- exllamav3 {version} has no DeepSeek-V4.1 architecture: this V4.1 pack is for forks that share its "
           "kernels (docs/loader-profiles.md of quantizer, exllamav3)"] if m.source["arch"] == "v41" else []),
        _context_text(values), "",
        *_runbook(profile, given, values),
    ]


def _run_one_spark(m: Manifest, profile: LoaderProfile, given: str | None) -> list[str]:
    """Native ExLlamaV3's V4.1 loader serves weights from the mapped file as the pack's launch.env says."""
    launch = m.plan["launch"]
    values = _run_values(m, given, launch.get("context"))
    cold = (f"{launch['cold_experts']:,} cold routed experts ({launch['cold_share']:.2%} of the calibration's routed "
            "tokens) are left in the page cache with the drafter" if launch["cold_experts"] else
            "every routed expert is copied into GPU memory, the drafter left in the page cache")
    drafter = ("" if launch.get("drafter", True) else " The drafter is in source form, which the engine would "
               "dequantize into GPU memory, so it launches without it (`DRAFT=0`); build with `--overlay` for an "
               "EXL3 drafter served from the mapped file.")
    return [
        "Engine: native ExLlamaV3's V4.1 loader (vcruz305/exllamav3, branch `feat/gb10-ats-load` at the commit the "
        "recipe pins) on one DGX Spark in ATS addressing mode. `launch.env` in the pack's folder sets what the "
        f"engine copies into GPU memory and what it serves from the mapped shards (`EXL3_ATS_MMAP=1`, `EXL3_ATS_COPY`, "
        f"`DRAFT`): {cold}.{drafter}", "",
        (f"- context: `launch.env` sets `CTX={launch['context']}` and `CHUNK={launch['chunk']}`, what the pack was "
         "fitted for (the launcher's own default is 6,144 tokens); the fit table below gives the most that fits on "
         "one Spark" if launch.get("context") else
         "- context: `launch.env` sets none, so the launcher's 6,144 tokens; set `CTX` (a multiple of 256) before "
         "the launcher for more: the fit table below gives the most that fits on one Spark (docs/gb10-memory.md "
         "of quantizer, one Spark)"),
        *([f"- streams: the build planned {values['streams']}; the recipe's driver serves one"]
          if values["streams"] != "1" else []), "",
        *_runbook(profile, given, values),
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
    rounded = "" if q["bits"] == q["bpw"] else f"; exllamav3's record (quantization_config.json) rounds it to bits {q['bits']}"
    return f"{q['bpw']:g} {m.profile.bits_measure}{rounded}; codebook {m.plan['codebook']}"


def _bits(m: Manifest) -> str:
    q = m.quantization
    rows = [[cls, f"{t['tensors']:,}", size_text(t["bytes"]), f"{t['params']:,}",
             "" if t["bpw"] is None else f"{t['bpw']:.3f}"] for cls, t in m.totals.items()]
    hist = ", ".join(f"K {k}: {n:,}" for k, n in q["k_histogram"].items()) or "none"
    return "\n".join([
        "## Bits", "",
        f"{bits_text(m)}. EXL3 linears by K, the bits per weight each stores (16 = fp16): {hist}.", "",
        *([f"Every stored linear's K (or `source`, kept as the source stores it) is in `{K_MAP_NAME}`.", ""]
          if K_MAP_NAME in m.files else []),
        "Stored bits per source parameter, by tensor class: every byte a class stores, its scales and signs "
        "included, over the source's parameters (so above K, by most on small tensors):", "",
        "```", table(["class", "tensors", "bytes", "params", "stored bits/param"], rows), "```",
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
    """The fit table at the context the pack was planned for (pack/fit_table.py), then at the model's full context
    where that is longer; a pack that records no planned context is fitted at the full one, and says so."""
    if not f:
        return f"{FIT_HEADING}\n\nnot computed."
    planned = f.get("planned")
    note = context_note(f.get("planned_context"), f["context"])
    return "\n".join([
        FIT_HEADING, "",
        f"{note[0].upper()}{note[1:]}; {(planned or f)['streams']} stream(s), split {f['split']}, Engram {f['engram']}, "
        f"drafter {f['drafter']}, vision {f['vision']}, hardware profile {f['hardware']} "
        "(`quantizer fit PACK --sparks N` prints the same per-rank numbers):", "",
        *_fit_rows(planned or f),
        *([f"At the model's full context, {f['context']:,} tokens and one stream (`quantizer fit PACK --sparks N "
           f"--context {f['context']} --streams 1`):", "", *_fit_rows(f)] if planned else []),
        "Decode tok/s is a model, not a measurement (quantizer's docs/decode-speed.md): the bytes a token reads over "
        "GB10's bandwidth and the engine's kernel launches by the dispatch path each layer's expert layout takes, "
        "its constants fitted to published rates; with the drafter in brackets.",
    ])


def _fit_rows(f: dict) -> list[str]:
    """One fenced table: a row per Spark count and engine of fit_table's `topologies`."""
    rows = []
    for sparks, engines in f["topologies"].items():
        for engine, r in engines.items():
            mapped = r.get("mapped_gib") or [0.0] * len(r["weights_gib"])
            rows.append([sparks, engine, "yes" if r["fits"] else "no",
                         " / ".join(f"{w:,.3f}" + (f" (+{g:,.3f} mapped)" if g else "")
                                    for w, g in zip(r["weights_gib"], mapped)),
                         " / ".join(f"{g:,.3f}" for g in r["free_gib"]), f"{r['max_context']:,}",
                         _decode_cell(r.get("decode"))])
    return ["```", table(["Sparks", "engine", "fits", "weights GiB per rank", "free GiB per rank", "max context",
                          "decode tok/s (model)"], rows), "```", ""]


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
        ["KL 95th percentile over the tokens, nats", "not recorded" if q.kl_p95 is None else f"{q.kl_p95:.5f}"],
        ["top-1 agreement", f"{q.top1:.2%} ± {q.top1_stderr:.2%}"],
        ["perplexity, pack", f"{q.ppl:.4f}"],
        ["perplexity, source", f"{q.ppl_source:.4f}"],
        ["perplexity ratio (pack / source)", f"{q.ppl_ratio:.4f}"],
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
