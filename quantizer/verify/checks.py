"""`quantizer verify`: check that a pack is what its manifest says, from headers (and with --full, bytes).

Every check yields a Finding; a FAULT names the shard or tensor and what is wrong. Header-level checks
catch truncated, replaced, missing and extra shards, tensors beyond EOF, misalignment, an index that
disagrees with the shards, dropped tensors and trellis shapes that disagree with the K the manifest
claims, and the model card (README.md) must be the one the manifest gives (pack/card.py). Then the
layout check: the shards hold exactly the tensors of the pack spec (contract/pack_spec.py) of the K map they
carry, so a pack that is self-consistent but not what any plan makes is caught. Then the loader
check: the K and codebook each stored linear holds (read from the shards, not the manifest) against
the rules of a loader profile (contract/loader_profiles.py), by default the one the pack was made for; a fault
names the tensor, the rule and the engine code it comes from. The manifest's claims (every key of it:
source, plan, settings, bpw, K, aliases, files, measurement) must match the digest the pack stage (or
`ppl --record`) wrote of them, and what they sum up of the pack (bpw, bits, K histogram, head bits, bytes
and bpw per tensor class, each tensor's K and class) and k_map.json (every stored linear's K) must be what
the plan the shards carry gives, recomputed with the pack stage's own function, so a digest made again
over a false claim does not carry it. The pack directory holds exactly the files it owns (pack/owned.py): a
stray file or directory, and any symbolic link, is a fault, and each file the manifest records besides
the shards (index, configs, tokenizer, ...) has its recorded sha256. --full adds the sha256 of every
shard, which catches any flipped byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.safetensors_file import PAD_PREFIX, SafetensorsHeader, TensorEntry, read_header
from quantizer.checkpoint.source import INDEX_NAME, is_engram_table
from quantizer.contract.engine_config import EXLLAMAV3_FORM
from quantizer.contract.loader_profiles import ENGRAM_SIBLING, LoaderProfile, Violation, violations
from quantizer.contract.pack_spec import native_tensors, pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.stored_linear import StoredLinear
from quantizer.errors import UserError
from quantizer.exl3 import EXL3_QUANTIZED_LEAVES, Codebook, k_from_trellis, parse_codebook
from quantizer.fit.launch import read_launch
from quantizer.pack.fit_table import pack_fit_table
from quantizer.model.targets import target_map
from quantizer.model.tensor_classes import ENGRAM_TABLE as ENGRAM_TABLE_CLASS
from quantizer.pack.card import CARD_NAME, render_card, without_fit
from quantizer.pack.manifest import (
    K_MAP_NAME,
    MANIFEST_NAME,
    NATIVE,
    Manifest,
    held_k,
    held_plan,
    sha256_file,
    stored_bytes,
    summarise,
)
from quantizer.pack.owned import ENGRAM_SUFFIX, SYMLINK, engram_dir, engram_files, engram_records, owned_files, strays

EXL3_SCALES = ("suh", "svh")
# Names of an encoded linear's own leaves, which the plain-dtype check skips (its `.bias` is a plain tensor: checked).
QUANTIZED_SUFFIXES = tuple(f".{leaf}" for leaf in EXL3_QUANTIZED_LEAVES)


@dataclass(frozen=True)
class Finding:
    ok: bool
    subject: str
    what: str

    def line(self) -> str:
        return f"{'OK   ' if self.ok else 'FAULT'} {self.subject}: {self.what}"


@dataclass
class VerifyReport:
    pack: Path
    findings: list[Finding] = field(default_factory=list)

    @property
    def faults(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]

    def ok(self, subject: str, what: str) -> None:
        self.findings.append(Finding(True, subject, what))

    def fault(self, subject: str, what: str) -> None:
        self.findings.append(Finding(False, subject, what))

    def render(self) -> str:
        lines = [f.line() for f in self.findings]
        n = len(self.faults)
        lines.append(f"{self.pack}: " + (f"{n} fault(s)" if n else "clean"))
        return "\n".join(lines)


def verify_pack(pack: str | Path, full: bool = False, profile: LoaderProfile | None = None) -> VerifyReport:
    """All checks, the loader rules of `profile` (default: the profile the manifest names); raises
    UserError only when there is nothing to check against (no pack, no manifest, unknown profile)."""
    pack = Path(pack)
    if not pack.is_dir():
        raise UserError(f"{pack}: not a directory; pass the pack directory that holds manifest.json")
    manifest = Manifest.load(pack)
    profile = profile or manifest.profile
    report = VerifyReport(pack)
    headers = _check_shards(pack, manifest, profile, report)
    _check_files(pack, manifest, report)
    _check_tensors(manifest, headers, report)
    _check_index(pack, headers, profile, report)
    _check_exl3(manifest, headers, report)
    _check_aliases(manifest, report)
    _check_sources(manifest, report)
    _check_storage_config(pack, manifest, report)
    _check_claims(manifest, report)
    _check_card(pack, manifest, report)
    cfg = _model_config(pack, manifest, report)
    if cfg is not None:
        plan = _check_spec(cfg, manifest, headers, report)
        _check_summary(pack, cfg, plan, manifest, headers, report)
        linears = _check_loader(cfg, manifest, headers, profile, report)
        _check_contract(pack, cfg, manifest, headers, profile, linears, report)
    if full:
        _check_hashes(pack, manifest, report)
    return report


def _check_shards(pack: Path, manifest: Manifest, profile: LoaderProfile,
                  report: VerifyReport) -> dict[str, SafetensorsHeader]:
    """Existence, byte size, header bounds and alignment of every shard the manifest lists: 64-byte
    aligned with pad tensors, or (a profile whose engine hands every header entry to the model, pack_align
    1) back to back with no pad tensor."""
    align = profile.pack_align
    headers: dict[str, SafetensorsHeader] = {}
    for shard in manifest.shards:
        path = pack / shard.file
        if not path.is_file():
            report.fault(shard.file, "missing")
            continue
        size = path.stat().st_size
        if size != shard.bytes:
            report.fault(shard.file, f"{size:,} bytes but the manifest says {shard.bytes:,} (truncated or replaced)")
        try:
            header = read_header(path)
        except UserError as e:
            report.fault(shard.file, _without_path(str(e), path))
            continue
        headers[shard.file] = header
        misaligned = [e.name for e in _real(header) if e.offset % align]
        pads = [n for n in header.tensors if n.startswith(PAD_PREFIX)]
        if misaligned:
            report.fault(shard.file, f"{len(misaligned)} tensor(s) not {align}-byte aligned, e.g. {misaligned[0]}")
        elif pads and align == 1:
            report.fault(shard.file, Violation(shard.file, "index", f"{len(pads)} pad tensor(s) such as {pads[0]}, which "
                                               "the engine would hand to the model").reason(profile))
        elif size == shard.bytes:
            report.ok(shard.file, f"{size:,} bytes, {len(_real(header))} tensors, header in bounds"
                                  + (f", {align}-byte aligned" if align > 1 else ", no pad tensors"))
    return headers


def _check_files(pack: Path, manifest: Manifest, report: VerifyReport) -> None:
    """Only owned files in the pack (and its Engram directory), none a link; every file the manifest
    records besides the shards as it was written. A loader reads every *.safetensors in the folder, so a
    stray one changes the model; any other stray would be published beside the pack."""
    found = {pack: strays(pack, owned_files(manifest))}
    sibling = engram_dir(pack, manifest)
    if sibling is not None and sibling.is_dir():
        found[sibling] = strays(sibling, engram_files(manifest))
    for where, entries in found.items():
        prefix = "" if where == pack else f"{where.name}/"
        for name, what in entries.items():
            if what == SYMLINK:
                report.fault(prefix + name, "a symbolic link; a pack holds its own files and nothing of it is read "
                                            "through a link: put the file itself there, or remove the link")
            elif name.endswith(".safetensors"):
                report.fault(prefix + name, "shard not in the manifest; loaders would read it too")
            else:
                report.fault(prefix + name, f"{what}; not part of the pack, and publish refuses a pack that holds "
                                            "it: move it out")
    bad = 0
    for name in manifest.files:
        if name in found[pack]:
            continue  # a link or a directory: faulted above
        problem = manifest.file_problem(pack, name)
        if problem is None:
            continue
        bad += 1
        report.fault(name, f"{problem}: copy the pack again, or rebuild it")
    if not bad and not any(found.values()):
        report.ok("files", f"exactly the {len(owned_files(manifest))} files the manifest names, none a link; "
                           f"{len(manifest.files)} recorded files as written")


def _check_tensors(manifest: Manifest, headers: dict[str, SafetensorsHeader], report: VerifyReport) -> None:
    """Every tensor the manifest lists is in its shard, and no shard holds a tensor it does not list."""
    held = {name: shard for shard, h in headers.items() for name in _names(h)}
    missing = [n for n, t in manifest.tensors.items() if t.shard in headers and held.get(n) != t.shard]
    extra = [n for n in held if n not in manifest.tensors]
    for name in missing[:10]:
        report.fault(name, f"listed in {manifest.tensors[name].shard} but not found there")
    for name in extra[:10]:
        report.fault(name, f"in {held[name]} but not in the manifest")
    if len(missing) + len(extra) > 20:
        report.fault("tensors", f"{len(missing)} missing and {len(extra)} unlisted in all")
    engram_files = {s.file for s in manifest.shards if s.engram}
    for shard, header in headers.items():
        is_table = [is_engram_table(n) for n in _names(header)]
        if shard in engram_files and not all(is_table):
            report.fault(shard, f"Engram shard also holds {is_table.count(False)} non-table tensor(s)")
        if shard not in engram_files and any(is_table):
            report.fault(shard, "holds Engram table tensors outside the Engram shards")
    if not missing and not extra:
        report.ok("tensors", f"all {len(manifest.tensors):,} manifest tensors in their shards, none unlisted")


def _check_index(pack: Path, headers: dict[str, SafetensorsHeader], profile: LoaderProfile,
                 report: VerifyReport) -> None:
    """The index maps exactly the tensors the shards hold, each to the shard that holds it (a fault
    names the engine file behind the rule)."""
    def fault(what: str) -> None:
        report.fault(INDEX_NAME, Violation(INDEX_NAME, "index", what).reason(profile))

    path = pack / INDEX_NAME
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
        total = index["metadata"]["total_size"]
    except FileNotFoundError:
        fault("missing")
        return
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        fault(f"not a valid index ({type(e).__name__}: {e})")
        return
    held = {name: shard for shard, h in headers.items() for name in _names(h)}
    faults = 0
    for name, shard in weight_map.items():
        if shard not in headers:
            continue  # that shard's own fault is already reported
        if held.get(name) != shard:
            faults += 1
            if faults <= 10:
                fault(f"maps {name} to {shard}, which does not hold it")
    for name, shard in held.items():
        if name not in weight_map:
            faults += 1
            if faults <= 10:
                fault(f"does not name {name} (held by {shard})")
    payload = sum(e.nbytes for h in headers.values() for e in _real(h))
    if set(weight_map.values()) <= headers.keys() and total != payload:
        faults += 1
        fault(f"total_size {total:,} but the shards hold {payload:,} bytes of tensors")
    if not faults:
        pads = sum(n.startswith(PAD_PREFIX) for h in headers.values() for n in h.tensors)
        report.ok(INDEX_NAME, f"names exactly the {len(held):,} tensors of the shards"
                              + (f", not their {pads:,} alignment pads" if pads else ""))


def _check_exl3(manifest: Manifest, headers: dict[str, SafetensorsHeader], report: VerifyReport) -> None:
    """Each EXL3 linear's K (from trellis.shape[-1]/16) matches the manifest; suh/svh/marker fit the trellis."""
    entries = {name: e for h in headers.values() for name, e in h.tensors.items()}
    codebook = parse_codebook(manifest.plan["codebook"])
    keys = manifest.exl3_keys()
    bad = 0
    for key, K in keys.items():
        problem = _exl3_problem(key, K, codebook, entries)
        if problem:
            bad += 1
            if bad <= 10:
                report.fault(key, problem)
    if bad > 10:
        report.fault("exl3", f"{bad} EXL3 linears with faults in all")
    if not bad:
        report.ok("exl3", f"{len(keys):,} EXL3 linears: K matches trellis shapes, suh/svh/{codebook.value} consistent")


def _exl3_problem(key: str, K, codebook: Codebook, entries: dict[str, TensorEntry]) -> str | None:
    trellis = entries.get(f"{key}.trellis")
    if trellis is None:
        return None  # reported as a missing tensor already
    if trellis.dtype != "I16" or len(trellis.shape) != 3:
        return f"trellis is {trellis.dtype}{list(trellis.shape)}, not I16 (in/16, out/16, 16K)"
    stored_k = k_from_trellis(trellis.shape)
    if stored_k != float(K):
        return f"trellis holds K={stored_k:g} but the manifest says K={K}"
    for scale, dim in zip(EXL3_SCALES, (trellis.shape[0] * 16, trellis.shape[1] * 16)):
        e = entries.get(f"{key}.{scale}")
        if e is None:
            return f"{scale} is missing"
        if e.dtype != "F16" or e.shape != (dim,):
            return f"{scale} is {e.dtype}{list(e.shape)}, trellis needs F16[{dim}]"
    for cb in (Codebook.MUL1, Codebook.MCG):
        present = f"{key}.{cb.value}" in entries
        if present != (cb is codebook):
            return f"codebook marker .{cb.value} {'present' if present else 'missing'} in a {codebook.value} pack"
    return None


def _check_aliases(manifest: Manifest, report: VerifyReport) -> None:
    """An aliased expert stores nothing; the linear it points to must be stored (EXL3 or native)."""
    stored = _stored_linears(manifest)
    bad = 0
    for alias, target in manifest.aliases.items():
        if alias in stored:
            bad += 1
            report.fault(alias, "aliased but also stored")
        elif target not in stored:
            bad += 1
            report.fault(alias, f"aliased to {target}, which the pack does not store")
    if manifest.aliases and not bad:
        report.ok("aliases", f"{len(manifest.aliases)} aliased linears point at stored ones")


def _check_sources(manifest: Manifest, report: VerifyReport) -> None:
    """Nothing dropped: every source tensor is in the pack as it was, or as the linear(s) that replace it."""
    stored = _stored_linears(manifest)
    lost = []
    for name, fate in manifest.sources.items():
        if fate == NATIVE:
            ok = name in manifest.tensors and manifest.tensors[name].K == NATIVE
        elif "exl3" in fate:
            ok = bool(fate["exl3"]) and all(k in stored for k in fate["exl3"])
        elif "converted" in fate:
            ok = name in manifest.tensors
        elif "engram_dir" in fate:
            ok = bool(manifest.plan.get("engram_dir"))  # the tables themselves: _check_engram_dir
        else:
            ok = (fate.get("fp16") or fate.get("alias")) in stored
        if not ok:
            lost.append(name)
    for name in lost[:10]:
        report.fault(name, f"source tensor ({manifest.sources[name]}) is not in the pack")
    if len(lost) > 10:
        report.fault("sources", f"{len(lost)} source tensors missing from the pack in all")
    if not lost:
        report.ok("sources", f"all {len(manifest.sources):,} source tensors accounted for (native, EXL3, fp16, "
                             "converted, Engram directory or alias)")


def _check_storage_config(pack: Path, manifest: Manifest, report: VerifyReport) -> None:
    """quantization_config.json (exllamav3's record) agrees with the manifest on K."""
    try:
        storage = json.loads((pack / "quantization_config.json").read_text())["tensor_storage"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError) as e:
        report.fault("quantization_config.json", f"no readable tensor_storage ({type(e).__name__})")
        return
    keys = manifest.exl3_keys()
    wrong_k = [k for k, K in keys.items() if storage.get(k, {}).get("bits_per_weight") != K]
    if wrong_k:
        report.fault("quantization_config.json",
                     f"bits_per_weight disagrees with the manifest for {len(wrong_k)} linears, e.g. {wrong_k[0]}")
    else:
        report.ok("quantization_config.json", f"bits_per_weight of all {len(keys):,} EXL3 linears as in the manifest")


def _check_claims(manifest: Manifest, report: VerifyReport) -> None:
    """The manifest's claims (source fingerprint, loader, plan hash, settings) are as the pack stage wrote
    them, and the loader features follow from the loader profile and the aliases it names."""
    problem = manifest.claims_problem()
    if problem:
        report.fault(MANIFEST_NAME, f"{problem}; rebuild the pack, or copy it again from where it was built")
    else:
        report.ok(MANIFEST_NAME, "every claim as the pack stage (and ppl --record) wrote it (claims_sha256)")
    features = (["per-expert-K"] if manifest.profile.per_expert_k else []) + (["expert-aliases"] if manifest.aliases else [])
    if manifest.loader_features != features:
        report.fault(MANIFEST_NAME, f"loader_features {manifest.loader_features} but loader "
                                    f"{manifest.plan['loader']} with {len(manifest.aliases)} aliases implies {features}")


def _check_card(pack: Path, manifest: Manifest, report: VerifyReport) -> None:
    """README.md is the card the manifest gives (pack/card.py): its figures are the recorded ones."""
    path = pack / CARD_NAME
    if not path.is_file():
        report.fault(CARD_NAME, f"missing; write the pack's card with `quantizer card {pack}`")
        return
    try:
        fit = pack_fit_table(pack)
    except (UserError, OSError, ValueError, KeyError):
        fit = None  # headers the checks above fault; the rest of the card is still compared
    card, expected = path.read_text(errors="replace"), render_card(manifest, fit)
    if card == expected:
        report.ok(CARD_NAME, "the model card of this manifest")
    elif without_fit(card) == without_fit(expected):
        report.ok(CARD_NAME, "the model card of this manifest; its fit section was computed against another "
                             f"hardware profile than today's (`quantizer card {pack}` refreshes it)")
    else:
        report.fault(CARD_NAME, "is not the card this quantizer writes for this manifest (edited by hand, the "
                                "manifest changed since, or written by an earlier quantizer whose card differed); "
                                f"regenerate it with `quantizer card {pack}`")
def _check_contract(pack: Path, cfg: ModelConfig, manifest: Manifest, headers: dict[str, SafetensorsHeader],
                    profile: LoaderProfile, linears: list[StoredLinear], report: VerifyReport) -> None:
    """The pack-level rules of the loader profile: the quantization_config its engine reads, dtypes the
    model directory may not hold, the dtypes of plain tensors, where the Engram tables are. A fault names
    the rule and the engine file it comes from."""
    def fault(subject: str, rule: str, what: str) -> None:
        report.fault(subject, Violation(subject, rule, what).reason(profile))

    try:
        config = json.loads((pack / "config.json").read_text())
        qcfg = config["quantization_config"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError) as e:
        fault("config.json", "quantization_config", f"no readable quantization_config ({type(e).__name__})")
        config, qcfg = {}, None
    text = config.get("text_config") or config
    missing = [k for k in profile.required_config_keys
               if (text if k.startswith("text_config.") else config).get(k.removeprefix("text_config.")) is None]
    if missing:
        fault("config.json", "required_config_keys", f"no {', '.join(missing[:5])}"
                                                     f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}")
    elif profile.required_config_keys:
        report.ok("config.json", f"all {len(profile.required_config_keys)} keys the {profile.name} engine reads")
    if profile.architectures and config.get("architectures") != list(profile.architectures):
        fault("config.json", "architectures", f"architectures {config.get('architectures')}; the engine asserts "
                                              f"{list(profile.architectures)}")
    for name in profile.required_files:
        if not (pack / name).is_file():
            fault(name, "required_files", "missing from the pack directory, which the engine reads it from")
    _check_launch(pack, manifest, report)
    if qcfg is not None:
        record = {"bits": manifest.quantization["bits"], "bpw": manifest.quantization["bpw"],
                  "codebook": manifest.plan["codebook"], "head_bits": manifest.plan["head_bits"]}
        source = {"quantization_config": manifest.source.get("quantization_config")}
        want = profile.engine_quantization_config(record, source, cfg, linears)
        fields = want if profile.quantization_config != EXLLAMAV3_FORM else {k: record[k] for k in ("bits", "bpw")}
        wrong = {k: qcfg.get(k) for k, v in fields.items() if qcfg.get(k) != v}
        if wrong or (profile.quantization_config == EXLLAMAV3_FORM and not isinstance(qcfg.get("bits"), int)):
            fault("config.json", "quantization_config", f"quantization_config has {wrong or qcfg.get('bits')}, "
                                                        f"the engine reads {fields}")
        else:
            report.ok("config.json", f"quantization_config is the {profile.name} engine's: "
                                     f"{json.dumps(fields, separators=(',', ':'))}")
    held = {name: (shard, e) for shard, h in headers.items() for name, e in h.tensors.items()
            if not name.startswith(PAD_PREFIX)}
    bad = [(n, e.dtype) for n, (_, e) in held.items() if e.dtype in profile.forbidden_dtypes]
    for name, dtype in bad[:10]:
        fault(name, "forbidden_dtypes", f"{dtype} tensor in the model directory, which the engine cannot read")
    if profile.forbidden_dtypes and not bad:
        report.ok("dtypes", f"no {'/'.join(profile.forbidden_dtypes)} tensor in the model directory")
    plain = [(n, e.dtype, profile.plain_dtype(n, e.dtype)) for n, (_, e) in held.items()
             if not n.endswith(QUANTIZED_SUFFIXES) and profile.plain_dtype(n, e.dtype) != e.dtype]
    for name, dtype, wanted in plain[:10]:
        fault(name, "plain_dtypes", f"{dtype}; the engine's loader reads it as {wanted}")
    if profile.plain_dtypes and not plain:
        report.ok("plain dtypes", f"every plain tensor in a dtype the {profile.name} loader converts")
    _check_engram_dir(pack, cfg, manifest, held, profile, fault, report)


def _check_launch(pack: Path, manifest: Manifest, report: VerifyReport) -> None:
    """A pack whose engine serves weights from the mapped file carries its launch settings, readable, with the
    drafter, context and prefill chunk the manifest records (fit/launch.py; pack/manifest.py `launch_problem`)."""
    launch = manifest.plan.get("launch")
    if not launch:
        return
    problem = manifest.launch_problem(pack)
    if problem:
        report.fault(launch["file"], _without_path(problem, pack / launch["file"]))
        return
    found = read_launch(pack)
    context = f", CTX={found.context}" if found.context else ""
    report.ok(launch["file"], f"copy pattern, DRAFT={int(found.drafter)}{context} for the engine's launcher")


def _check_engram_dir(pack: Path, cfg: ModelConfig, manifest: Manifest, held: dict, profile: LoaderProfile,
                      fault, report: VerifyReport) -> None:
    """Engram tables: in the pack's own shards, or (sibling) none there and every one in the sibling
    directory's shards as the source holds it, listed in its index."""
    tables = [t for t in native_tensors(cfg) if t.cls == ENGRAM_TABLE_CLASS]
    if profile.engram_tables != ENGRAM_SIBLING:
        missing = [t.name for t in tables if t.name not in held]
        for name in missing[:10]:
            fault(name, "engram_tables", "Engram table not in the pack's shards")
        if tables and not missing:
            report.ok("engram", f"{len(tables)} Engram table tensors in the pack's shards, in the index")
        return
    inside = [t.name for t in tables if t.name in held]
    for name in inside[:10]:
        fault(name, "engram_tables", "Engram table inside the model directory; the engine reads it from its own directory")
    where = engram_dir(pack, manifest) or pack.with_name(pack.name + ENGRAM_SUFFIX)
    try:
        weight_map = json.loads((where / INDEX_NAME).read_text())["weight_map"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError) as e:
        fault(str(where), "engram_tables", f"no readable Engram directory index ({type(e).__name__})")
        return
    records = engram_records(pack, manifest)
    cut = {path.name: path.stat().st_size for path, record in records.items()
           if path.is_file() and path.stat().st_size != record.bytes}
    for name, size in cut.items():
        report.fault(f"{where.name}/{name}", f"{size:,} bytes but the manifest says {records[where / name].bytes:,} "
                                             "(truncated or replaced)")
    wrong = []
    for t in tables:
        shard = weight_map.get(t.name)
        if shard in cut:
            continue  # faulted above; its header may point past its end
        entry = read_header(where / shard).tensors.get(t.name) if shard and (where / shard).is_file() else None
        if entry is None or entry.dtype != t.dtype or tuple(entry.shape) != t.shape:
            wrong.append(t.name)
    for name in wrong[:10]:
        fault(name, "engram_tables", f"not in {where.name}/ as the source holds it")
    if not wrong and not inside and not cut:
        report.ok("engram", f"{len(tables)} Engram table tensors in {where.name}/ (point the engine at it), none in the pack")



def _model_config(pack: Path, manifest: Manifest, report: VerifyReport) -> ModelConfig | None:
    """The model's config, with the source's FP8 block grid (the manifest keeps it: the pack's own
    quantization_config is EXL3's)."""
    try:
        return manifest.model_config(pack)
    except UserError as e:
        report.fault("config.json", f"cannot read the model config ({e}); the layout and loader checks need it")
        return None


def _check_spec(cfg: ModelConfig, manifest: Manifest, headers: dict[str, SafetensorsHeader],
                report: VerifyReport) -> Plan:
    """The shards hold exactly the pack spec (contract/pack_spec.py) of the K map they carry: every native
    tensor of the model's layout in its shape and dtype, every stored linear's leaves, nothing else. Returns
    the plan the shards carry."""
    entries = {name: e for h in headers.values() for name, e in h.tensors.items() if not name.startswith(PAD_PREFIX)}
    plan = held_plan(cfg, manifest, entries)
    want = {t.name: t for t in pack_spec(cfg, plan).model_dir}
    faults = [f"missing ({t.dtype}{list(t.shape)})" if n not in entries else None for n, t in want.items()]
    problems = {n: f for n, f in zip(want, faults) if f}
    problems |= {n: f"is {e.dtype}{list(e.shape)}, the layout says {want[n].dtype}{list(want[n].shape)}"
                 for n, e in entries.items() if n in want and (tuple(e.shape) != want[n].shape or e.dtype != want[n].dtype)}
    problems |= {n: "not a tensor of the model's layout at the K the pack holds" for n in entries if n not in want}
    for name, what in sorted(problems.items())[:10]:
        report.fault(name, what)
    if len(problems) > 10:
        report.fault("layout", f"{len(problems)} tensors differ from the pack spec in all")
    if not problems:
        report.ok("layout", f"the shards hold exactly the {len(want):,} tensors of the pack spec of the K map they carry")
    return plan


def _check_summary(pack: Path, cfg: ModelConfig, plan: Plan, manifest: Manifest,
                   headers: dict[str, SafetensorsHeader], report: VerifyReport) -> None:
    """What the manifest and k_map.json sum up (bpw, bits, K histogram, head bits, each class's totals, each
    tensor's K and class, every linear's K) is what the plan the shards carry gives, computed by the pack
    stage's own function (pack/manifest.py `summarise`): a digest made again over a false claim does not
    carry it."""
    entries = {name: e for h in headers.values() for name, e in h.tensors.items()}
    summary = summarise(cfg, plan, stored_bytes(entries))
    wrong = manifest.summary_faults(summary)
    for line in wrong:
        report.fault(MANIFEST_NAME, line)
    if not wrong:
        report.ok(MANIFEST_NAME, f"bpw {summary.quantization['bpw']:g}, bits {summary.quantization['bits']}, the K "
                                 "histogram, head bits, class totals and tensor records as the shards give them")
    if K_MAP_NAME not in manifest.files:
        report.fault(K_MAP_NAME, "not in the pack, which records every linear's K there; rebuild the pack (a build "
                                 "into a new --out with the old --work repacks without encoding again)")
        return
    if (pack / K_MAP_NAME).is_symlink() or not (pack / K_MAP_NAME).is_file():
        return  # missing or a link: _check_files faults it
    try:
        k_map = json.loads((pack / K_MAP_NAME).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        report.fault(K_MAP_NAME, f"not readable ({type(e).__name__})")
        return
    if not isinstance(k_map, dict):
        report.fault(K_MAP_NAME, "not a JSON object of linear -> K")
        return
    differ = sorted(set(k_map) ^ set(summary.k_map)) + sorted(
        n for n in set(k_map) & set(summary.k_map) if k_map[n] != summary.k_map[n])
    if differ:
        name = differ[0]
        report.fault(K_MAP_NAME, f"{len(differ)} linear(s) differ from the shards, e.g. {name}: claims "
                                 f"{k_map.get(name, 'nothing')}, the shards hold {summary.k_map.get(name, 'nothing')}")
    else:
        report.ok(K_MAP_NAME, f"the K of all {len(k_map):,} stored linears as the shards hold them")


def _check_loader(cfg: ModelConfig, manifest: Manifest, headers: dict[str, SafetensorsHeader], profile,
                  report: VerifyReport) -> list[StoredLinear]:
    """Every rule of the loader profile on the stored linears, with the K and codebook the shards hold
    for each (layout: EXL3 or source form per group); returns those linears."""
    tmap = target_map(cfg)
    entries = {name: e for h in headers.values() for name, e in h.tensors.items()}
    linears = []
    for key, t in tmap.items():
        if key in manifest.aliases:
            continue
        stored = [key] if f"{key}.trellis" in entries or f"{key}.weight" in entries else \
            sorted({n.rsplit(".", 1)[0] for n in entries if n.startswith(f"{key}.slice.") and n.endswith(".trellis")})
        for s in stored:
            linears.append(StoredLinear(s, t, *held_k(s, entries)))
    broken = violations(profile, linears, manifest.aliases)
    for v in broken[:20]:
        report.fault(v.subject, v.reason(profile))
    if len(broken) > 20:
        report.fault(f"loader {profile.name}", f"{len(broken)} rule violations in all")
    if not broken:
        report.ok(f"loader {profile.name}", f"{len(linears):,} linears keep every rule of the {profile.name} profile "
                                            f"({profile.engine})")
    return linears


def _check_hashes(pack: Path, manifest: Manifest, report: VerifyReport) -> None:
    """The sha256 of every shard: the pack's, and those of its sibling Engram directory (the source's)."""
    recorded = {pack / s.file: s.sha256 for s in manifest.shards}
    recorded |= {path: r.sha256 for path, r in engram_records(pack, manifest).items()}
    present = {path: digest for path, digest in recorded.items() if path.is_file()}
    with tqdm(total=sum(p.stat().st_size for p in present), unit="B", unit_scale=True, desc="sha256") as bar:
        for path, want in present.items():
            name = str(path.relative_to(pack)) if path.parent == pack else f"{path.parent.name}/{path.name}"
            digest = sha256_file(path, bar.update)
            if digest != want:
                report.fault(name, f"sha256 {digest[:16]}... differs from the manifest's {want[:16]}... (corrupt)")
            else:
                report.ok(name, "sha256 matches")


def _stored_linears(manifest: Manifest) -> set[str]:
    """Keys the pack stores a linear under: EXL3 (a trellis) or a plain `.weight` (native or fp16)."""
    return set(manifest.exl3_keys()) | {n[: -len(".weight")] for n in manifest.tensors if n.endswith(".weight")}


def _real(header: SafetensorsHeader) -> list[TensorEntry]:
    return [e for n, e in header.tensors.items() if not n.startswith(PAD_PREFIX)]


def _names(header: SafetensorsHeader) -> list[str]:
    return [e.name for e in _real(header)]


def _without_path(message: str, path: Path) -> str:
    prefix = f"{path}: "
    return message[len(prefix):] if message.startswith(prefix) else message
