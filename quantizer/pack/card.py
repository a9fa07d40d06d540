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

from quantizer.contract.loader_profiles import load_profile
from quantizer.pack.fit_table import pack_fit_table
from quantizer.model.tensor_classes import DRAFTER, ENGRAM_TABLE, VISION, classify
from quantizer.pack.manifest import MANIFEST_NAME, NATIVE, Manifest
from quantizer.pack.measurement import Measurement
from quantizer.report import size_text, table
from quantizer.workdir import write_json_atomic, write_text_atomic

CARD_NAME = "README.md"
LIBRARY = "exllamav3"
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


def front_matter(m: Manifest) -> dict:
    """The Hugging Face metadata: base_model (and its relation) only when the source is a known repo."""
    meta: dict = {}
    if m.source.get("base_model"):
        meta["base_model"] = m.source["base_model"]
        meta["base_model_relation"] = "quantized"
    meta["library_name"] = LIBRARY
    meta["pipeline_tag"] = "text-generation"
    if m.source.get("license"):
        meta["license"] = m.source["license"]
    meta["tags"] = list(dict.fromkeys(["exl3", LIBRARY, m.plan["loader"], "quantizer", m.source["arch"]]))
    return meta


FIT_HEADING = "## Fit on DGX Sparks"


def render_card(m: Manifest, fit: dict | None) -> str:
    """The card's text: a function of the manifest and the pack's fit table (pack/fit_table.py;
    verify compares README.md with it)."""
    source_classes = {classify(name).cls for name in m.sources}
    sections = [
        "---\n" + yaml.safe_dump(front_matter(m), sort_keys=False) + "---",
        _title(m),
        _source(m),
        _loads_in(m),
        *_launch(m),
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
    profile = load_profile(m.plan["loader"])
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


def _launch(m: Manifest) -> list[str]:
    """How to start a pack whose engine serves weights from the mapped file (its launch.env), or nothing."""
    launch = m.plan.get("launch")
    if not launch:
        return []
    cold = (f"{launch['cold_experts']:,} cold routed experts ({launch['cold_share']:.2%} of the calibration's routed "
            "tokens) are left in the page cache with the drafter" if launch["cold_experts"] else
            "every routed expert is copied into GPU memory, the drafter left in the page cache")
    drafter = ("" if launch.get("drafter", True) else " The drafter is in source form, which the engine would "
               "dequantize into GPU memory, so it launches without it (`DRAFT=0`); build with `--overlay` for an "
               "EXL3 drafter served from the mapped file.")
    return ["\n".join([
        "## Run it on one Spark", "",
        "Native ExLlamaV3's V4.1 loader (vcruz305/exllamav3, branch `feat/gb10-ats-load`; the recipe pins commit "
        "`954a8ca6e59d`), one Spark in ATS addressing mode. `launch.env` in this folder sets what the engine copies "
        f"into GPU memory and what it serves from the mapped shards: {cold}.{drafter} Load it before the recipe's "
        "launcher (vcruz305/DeepSeek-V4.1-Flash-EXL3-DGX-Spark-recipe, `one-spark-tp1/scripts/run_tp1.sh`, which "
        "keeps variables already set):", "",
        "```", "set -a; . ./launch.env; set +a", "MODEL_DIR=$PWD one-spark-tp1/scripts/run_tp1.sh", "```",
    ])]


def _bits(m: Manifest) -> str:
    q = m.quantization
    rows = [[cls, f"{t['tensors']:,}", size_text(t["bytes"]), f"{t['params']:,}",
             "" if t["bpw"] is None else f"{t['bpw']:.3f}"] for cls, t in m.totals.items()]
    hist = ", ".join(f"K {k}: {n:,}" for k, n in q["k_histogram"].items()) or "none"
    return "\n".join([
        "## Bits", "",
        f"bits {q['bits']}, {q['bpw']:g} bpw over the budgeted tensors, codebook `{m.plan['codebook']}`. "
        f"Linears by K (16 = fp16): {hist}.", "",
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
    cal = m.settings.get("calibration")
    if not cal:
        return "## Calibration\n\nnone: the linears were quantized without Hessians."
    return (f"## Calibration\n\n{cal['rows']:,} rows x {cal['cols']:,} tokens of {_calibration_text(m)}; "
            f"Hessians fingerprint `{cal['fingerprint']}`.{_tuning(m)}")


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
        if flag in command[:-1]:
            return f"`{Path(command[command.index(flag) + 1]).name}` ({flag})"
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
            rows.append([sparks, engine, "yes" if r["fits"] else "no",
                         " / ".join(f"{w:,.3f}" + (f" (+{g:,.3f} mapped)" if g else "")
                                    for w, g in zip(r["weights_gib"], mapped)),
                         " / ".join(f"{g:,.3f}" for g in r["free_gib"]), f"{r['max_context']:,}"])
    return "\n".join([
        FIT_HEADING, "",
        f"At {f['context']:,} tokens x {f['streams']} stream(s), split {f['split']}, Engram {f['engram']}, "
        f"drafter {f['drafter']}, vision {f['vision']}, hardware profile {f['hardware']} "
        "(`quantizer fit PACK --sparks N` prints the same per-rank numbers):", "",
        "```", table(["Sparks", "engine", "fits", "weights GiB per rank", "free GiB per rank", "max context"], rows),
        "```",
    ])


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
