"""The pack stage: quantized results + native pass-through tensors -> a loadable, verifiable pack.

Everything is written into a partial directory beside `<out>` (the build job's own
`<out>.partial-<job id>`, or a fresh one) and renamed to `<out>` last, so a half-written pack never
looks complete and a pack another build published meanwhile is never replaced. Every source tensor is
accounted for: it is passed through byte-identical, replaced by the EXL3 (or fp16) linear(s) the plan
gave it, served by the expert it is aliased to, stored in the dtype the engine's loader reads (a plain
tensor its profile converts), or kept in the sibling Engram directory `<out>-Engram` (profiles whose
engine reads the Engram tables from a directory of their own: the source shards that hold them, linked);
nothing is dropped silently (a missing quantized result stops the stage with the key to redo).
config.json carries the quantization_config the plan's engine reads (its loader profile's form).
Of the source's other files only the tokenizer, generation and licence files (SIDE_FILES, from
checkpoint/source.py) are copied; the manifest records every file the stage writes or copies besides
the shards, with its sha256 (`files`): what the pack owns (pack/owned.py). A file a loader profile
adds is recorded there too, and so is k_map.json, every stored linear's K (pack/manifest.py `summarise`,
which also gives the manifest's bpw, K histogram and totals, as verify recomputes them).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from importlib import metadata
from pathlib import Path

import torch
from tqdm import tqdm

from quantizer import __version__
from quantizer.calibrate.storage import HessianRecord
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.fingerprint import shard_records, source_fingerprint
from quantizer.checkpoint.safetensors_file import (
    PAD_PREFIX,
    TORCH_DTYPES,
    TensorEntry,
    planned,
    read_header,
    read_tensor,
    write_safetensors,
)
from quantizer.checkpoint.source import INDEX_NAME, SIDE_FILES, Checkpoint
from quantizer.contract.loader_profiles import ENGRAM_SIBLING
from quantizer.contract.pack_spec import CONVERTED, ENGRAM_DIR, REPLACED_LEAVES, PackSpec, StoredTensor, alias_of, pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.rules import achieved_bpw
from quantizer.errors import UserError
from quantizer.exl3 import PACK_ALIGN, UNQUANTIZED, parse_codebook
from quantizer.fit.hardware import load_hardware
from quantizer.fit.launch import LAUNCH_FILE, Launch, write_launch
from quantizer.fit.target import drafter_in_exl3
from quantizer.model.targets import targets
from quantizer.pack.card import source_license, write_card
from quantizer.pack.exl3_config import EXLLAMAV3_TARGET, pack_config, quantization_config, tensor_storage
from quantizer.pack.manifest import (
    K_MAP_NAME,
    MANIFEST_NAME,
    NATIVE,
    FileRecord,
    Manifest,
    Planned,
    ShardRecord,
    Summary,
    TensorRecord,
    head_bits,
    sha256_file,
    summarise,
    tensor_k,
)
from quantizer.pack.owned import engram_dir_of
from quantizer.pack.shards import PackTensor, ShardPlan, assign_shards, link_or_copy, reusable_sources, write_shards
from quantizer.quantize.linears import plan_units
from quantizer.quantize.results import ResultStore
from quantizer.report import size_text
from quantizer.workdir import require_free_space, write_json_atomic

DEFAULT_SHARD_SIZE = 8 << 30
CONVERTED_FILE = "converted.scratch"  # plain tensors in the engine's dtypes, copied into shards, then removed
CONFIG_FILES = ("config.json", "quantization_config.json")  # written by _write_configs


@dataclass(frozen=True)
class PackSettings:
    job_settings: dict  # the quantize stage's settings record (seed, device, encoder, ...): names the units
    shard_size: int = DEFAULT_SHARD_SIZE
    revision: str | None = None  # of a Hugging Face source, for the manifest
    base_model: str | None = None  # the source's Hugging Face repo id, for the card
    command: tuple[str, ...] | None = None  # the command line that built the pack, for the card
    tuned_files: tuple[Path, ...] = ()  # the tune stage's block files: their suh/svh replace the unit store's
    tuning: dict | None = None  # the tune stage's record (settings, rows, held-out error ratios), for the manifest
    end_to_end: dict | None = None  # the end-to-end tuning's record (settings, rows, held-out KL), for the manifest
    launch: Launch = Launch()  # cold experts, where the profile's engine serves weights from the mapped file
    planned: Planned | None = None  # the Spark count, context and streams the plan was fitted to (build's --sparks)


def write_pack(ck: Checkpoint, plan: Plan, work: str | Path, out: str | Path, settings: PackSettings,
               partial: Path | None = None, publish: bool = True) -> Manifest:
    """The pack of `plan` from the results in `work`, written in `partial` (an empty directory beside
    `out` that the caller owns; by default a fresh one, removed if this fails) and renamed to `out`;
    with `publish` False the caller renames it (publish_pack) once its own checks of `partial` pass."""
    out = Path(out)
    check_new_pack_dir(out)
    engram = engram_dir_of(out)
    sibling = plan.profile.engram_tables == ENGRAM_SIBLING
    if sibling:
        check_new_pack_dir(engram)
    owned = partial is None
    if owned:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))
    engram_partial = engram_dir_of(partial)
    try:
        manifest = _write(ck, plan, ResultStore(work), partial, settings, engram_partial, engram.name)
        if publish:
            publish_pack(partial, out)
        return manifest
    except BaseException:
        if owned:
            shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(engram_partial, ignore_errors=True)
        raise


def _write(ck: Checkpoint, plan: Plan, store: ResultStore, partial: Path, settings: PackSettings,
           engram_dir: Path, engram_name: str) -> Manifest:
    spec = pack_spec(ck.config, plan)
    tensors, sources = _pack_tensors(ck, plan, spec, store, settings.job_settings, partial / CONVERTED_FILE,
                                     settings.tuned_files)
    align = plan.profile.pack_align
    shards = assign_shards(tensors, settings.shard_size, reusable_sources(tensors, align))
    size = sum(s.nbytes for s in shards)
    linkable = sum(s.nbytes for s in shards if s.reuse and os.stat(s.reuse).st_dev == os.stat(partial).st_dev)
    link = (f", and {size_text(linkable)} of the source's Engram shards to link into it (copied where the filesystem "
            "refuses links)" if linkable else "")
    print(f"pack: {len(tensors):,} tensors in {len(shards)} shards, {size_text(size)} in {partial}; "
          f"{size_text(size - linkable)} to write{link}", file=sys.stderr)
    require_free_space(partial, size - linkable, "the pack")
    made = write_shards(partial, shards, align)
    (partial / CONVERTED_FILE).unlink(missing_ok=True)
    reused = [how for s, how in zip(shards, made) if s.reuse]
    if reused:
        print(f"pack: {len(reused)} Engram source shard(s) reused: {', '.join(sorted(set(reused)))}", file=sys.stderr)
    records = _shard_records(partial, shards)
    _write_index(partial, shards)
    qcfg = _write_configs(ck, plan, spec, tensors, partial, _calibration_tokens(settings))
    summary = summarise(ck.config, plan, {t.name: t.nbytes for t in tensors})
    write_json_atomic(partial / K_MAP_NAME, summary.k_map)
    written = [INDEX_NAME, *CONFIG_FILES, K_MAP_NAME, *_copy_side_files(ck.root, partial)]
    launch = _write_launch(ck.config, plan, settings.launch, partial)
    if launch:
        written.append(launch["file"])
    files = _file_records(partial, written)  # every file the pack owns besides shards, manifest and card
    sibling = _write_engram_dir(ck, spec, engram_dir)
    if sibling:
        sibling["dir"] = engram_name
    manifest = _manifest(ck, plan, summary, shards, records, sources, qcfg, settings, sibling, launch, files)
    write_json_atomic(partial / MANIFEST_NAME, manifest.to_dict())
    write_card(partial, manifest)
    return manifest


def publish_pack(partial: Path, out: Path) -> None:
    """Rename the finished pack (and its sibling Engram directory, where its profile has one) into
    place; the kernel refuses if a target is (no longer) empty."""
    if engram_dir_of(partial).is_dir():
        _rename(engram_dir_of(partial), engram_dir_of(out))
    _rename(partial, out)


def discard_partial(partial: Path) -> None:
    """Remove a pack that will not be published, with its sibling Engram directory."""
    shutil.rmtree(engram_dir_of(partial), ignore_errors=True)
    shutil.rmtree(partial, ignore_errors=True)


def _rename(partial: Path, out: Path) -> None:
    try:
        os.rename(partial, out)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        raise UserError(f"{out}: appeared while this build was packing (another build?); it was left as it is. "
                        "Choose another --out and rerun: the work directory is kept, so only packing runs again")


def check_new_pack_dir(out: Path) -> None:
    """A pack is written once: an existing non-empty directory is never overwritten."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: already exists and is not empty; delete it or choose another --out")


def _pack_tensors(ck: Checkpoint, plan: Plan, spec: PackSpec, store: ResultStore, job: dict, converted: Path,
                  tuned: tuple[Path, ...] = ()):
    """Every tensor of the pack directory with the bytes it copies, and what became of every source
    tensor. The checkpoint must hold exactly the tensors its config's layout has, and the cache a result
    of the spec's shape and dtype for every encoded leaf, from units made under `job` (the quantize
    settings' record). Plain tensors the loader reads in another dtype are converted into `converted`
    (a scratch file the shards copy from). `tuned`: the tune stage's block files, whose suh/svh are taken
    in place of the unit store's."""
    _check_source(ck, spec)
    results = store.entries(plan_units(spec, plan.codebook, job))
    for path in tuned:  # tuned suh/svh: same names, shapes and dtype as the unit store's (tune/store.py)
        results.update({n: e for n, e in read_header(path).tensors.items() if not n.startswith(PAD_PREFIX)})
    linears = {s.key: s for s in spec.encoded}
    changed = _convert(ck, [t for t in spec.tensors if t.storage == CONVERTED], converted)
    tensors: list[PackTensor] = []
    for t in spec.model_dir:
        if t.linear is None:
            tensors.append(PackTensor(t.name, changed.get(t.name, ck.tensors[t.name]), NATIVE, t.cls))
            continue
        entry = results.get(t.name)
        if entry is None or tuple(entry.shape) != t.shape or entry.dtype != t.dtype:
            found = "missing" if entry is None else f"{entry.dtype}{list(entry.shape)}"
            raise UserError(f"{store.dir}: quantized result {t.name} is {found}, expected {t.dtype}{list(t.shape)}; "
                            "rerun the quantize stage (build) with the same work directory")
        tensors.append(PackTensor(t.name, entry, tensor_k(t, linears), t.cls))
    return tensors, _sources(ck, plan, spec)


def _convert(ck: Checkpoint, plain: list[StoredTensor], path: Path) -> dict[str, TensorEntry]:
    """The plain tensors the spec stores in another dtype, converted (BF16 -> F16 or F32: the dtypes
    the engine's loader takes; docs/loader-profiles.md) into one file; their entries there."""
    if not plain:
        return {}
    write_safetensors(path, [planned(t.name, read_tensor(ck.tensors[t.name]).to(TORCH_DTYPES[t.dtype]))
                             for t in plain], align=PACK_ALIGN)
    return read_header(path).tensors


def _check_source(ck: Checkpoint, spec: PackSpec) -> None:
    """A tensor the layout does not know would be dropped, one it expects but the checkpoint lacks
    (or holds in another shape) would make the pack differ from its plan: both stop the stage."""
    layout = {t.name: t for t in spec.tensors if t.linear is None} | dict.fromkeys(spec.replaced)
    extra = [name for name in ck.tensors if name not in layout]
    if extra:
        raise UserError(f"{ck.root}: {len(extra)} tensor(s) the model's layout does not have, e.g. {extra[0]} "
                        "(a checkpoint of another model or revision?)")
    for name, t in layout.items():
        entry = ck.tensors.get(name)
        if entry is None and t is not None:
            raise UserError(f"{ck.root}: no tensor {name}, which the model's layout has (an incomplete checkpoint?)")
        if t is not None and (tuple(entry.shape) != t.shape or (entry.dtype != t.dtype and t.storage != CONVERTED)):
            raise UserError(f"{ck.root}: {name} is {entry.dtype}{list(entry.shape)}, the layout says "
                            f"{t.dtype}{list(t.shape)}")


def _sources(ck: Checkpoint, plan: Plan, spec: PackSpec) -> dict[str, object]:
    """Per source tensor: passed through, or the alias, fp16 weight or EXL3 linears that replace it."""
    by_target: dict[str, list[str]] = defaultdict(list)
    for s in spec.encoded:
        by_target[s.target.key].append(s.key)
    fates: dict[str, object] = {}
    for t in targets(ck.config):
        k = plan.k[t.key]
        if k is None:
            continue
        if alias_of(plan, t.key):
            fate = {"alias": alias_of(plan, t.key)}
        elif k == UNQUANTIZED:
            fate = {"fp16": t.key}
        else:
            fate = {"exl3": by_target[t.key]}
        fates.update({t.key + leaf: fate for leaf in REPLACED_LEAVES})
    for t in spec.tensors:
        if t.storage == CONVERTED:
            fates[t.name] = {"converted": t.dtype}
        elif t.storage == ENGRAM_DIR:
            fates[t.name] = {"engram_dir": t.name}
    return {name: fates.get(name, NATIVE) for name in ck.tensors}


def _shard_records(pack: Path, shards: list[ShardPlan]) -> list[ShardRecord]:
    """sha256 of every shard as written (a read-back, so the manifest pins what is on disk)."""
    records = []
    total = sum((pack / s.file).stat().st_size for s in shards)
    with tqdm(total=total, unit="B", unit_scale=True, desc="sha256") as bar:
        for s in shards:
            path = pack / s.file
            records.append(ShardRecord(s.file, path.stat().st_size, sha256_file(path, bar.update), s.engram))
    return records


def _write_index(pack: Path, shards: list[ShardPlan]) -> None:
    weight_map = {t.name: s.file for s in shards for t in s.tensors}
    index = {
        "metadata": {"total_size": sum(s.nbytes for s in shards)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_json_atomic(pack / INDEX_NAME, index)


def _calibration_tokens(settings: PackSettings) -> dict | None:
    """{rows, cols} of the token rows the Hessians came from (exllamav3's "calibration"), or None for an
    uncalibrated pack."""
    record = settings.job_settings.get("calibration")
    if not record:
        return None
    hessians = HessianRecord.from_dict(record, "the quantize job's settings")
    return {"rows": hessians.rows, "cols": hessians.cols}


def _source_config(ck: Checkpoint) -> dict:
    return json.loads((ck.root / "config.json").read_text())


def _write_configs(ck: Checkpoint, plan: Plan, spec: PackSpec, tensors: list[PackTensor], pack: Path,
                   calibration_tokens: dict | None) -> dict:
    """config.json with the quantization_config the plan's engine reads (its profile's form), and
    quantization_config.json with exllamav3's record plus tensor_storage. Returns exllamav3's record."""
    source_config = _source_config(ck)
    codebook = parse_codebook(plan.codebook)
    bpw = achieved_bpw(ck.config, plan)
    qcfg = quantization_config(source_config, bpw, head_bits(plan), codebook, calibration_tokens)
    engine_qcfg = plan.profile.engine_quantization_config(qcfg, source_config, ck.config, spec.linears)
    write_json_atomic(pack / "config.json", pack_config(source_config, engine_qcfg))
    write_json_atomic(pack / "quantization_config.json", {**qcfg, "tensor_storage": tensor_storage(tensors, codebook)})
    return qcfg


def _write_engram_dir(ck: Checkpoint, spec: PackSpec, where: Path) -> dict | None:
    """The source shards that hold the Engram tables, linked (copied where links fail) into `where`,
    with an index naming the tables; None when the profile keeps the tables in the pack."""
    tables = sorted(t.name for t in spec.tensors if t.storage == ENGRAM_DIR)
    if not tables:
        return None
    where.mkdir()
    files = sorted({ck.tensors[name].path for name in tables})
    how = {p.name: link_or_copy(p, where / p.name) for p in files}
    write_json_atomic(where / INDEX_NAME, {"metadata": {"total_size": sum(ck.tensors[n].nbytes for n in tables)},
                                           "weight_map": {n: ck.tensors[n].path.name for n in tables}})
    print(f"pack: the {len(files)} source shard(s) holding the Engram tables put in {where.name}/ beside the pack "
          f"({', '.join(sorted(set(how.values())))})", file=sys.stderr)
    hashed = shard_records(files)  # the source shards' digests, which pinning the source took this process
    return {"shards": sorted(how), "tables": len(tables),
            "files": {name: {"bytes": r["size"], "sha256": r["sha256"]} for name, r in hashed.items()}}


def _write_launch(cfg: ModelConfig, plan: Plan, launch: Launch, pack: Path) -> dict | None:
    """launch.env, where the plan's engine serves weights from the mapped file (fit/launch.py); what the
    manifest records of it, or None."""
    if load_hardware().engine(plan.profile.fit_engine).mapped is None:
        return None
    launch = replace(launch, drafter=drafter_in_exl3(cfg, plan))  # a source-form drafter is launched without
    write_launch(pack, launch)
    return {"file": LAUNCH_FILE, "cold_experts": len(launch.cold_experts), "cold_share": round(launch.cold_share, 6),
            "drafter": launch.drafter, "context": launch.context, "chunk": launch.chunk}


def side_files(src: Path) -> list[Path]:
    """The source's files that go into its packs (SIDE_FILES), in name order."""
    return [f for f in sorted(Path(src).iterdir()) if f.is_file() and any(fnmatchcase(f.name, p) for p in SIDE_FILES)]


def _copy_side_files(src: Path, pack: Path) -> list[str]:
    """Copy the side files into the pack as files of its own (a Hugging Face snapshot links them to its
    blobs: the link is followed here, never kept); returns their names."""
    names = []
    for f in side_files(src):
        shutil.copyfile(f, pack / f.name)
        names.append(f.name)
    return names


def _file_records(pack: Path, names: list[str]) -> dict[str, FileRecord]:
    """Size and sha256 of each file the stage wrote besides the shards, as it is on disk."""
    return {n: FileRecord((pack / n).stat().st_size, sha256_file(pack / n)) for n in sorted(names)}


def _manifest(ck, plan, summary: Summary, shards, records, sources, qcfg, settings: PackSettings,
              engram_dir: dict | None, launch: dict | None, files: dict[str, FileRecord]) -> Manifest:
    tensors = {t.name: TensorRecord(s.file, t.K, t.cls) for s in shards for t in s.tensors}
    aliases = {t.key: alias_of(plan, t.key) for t in targets(ck.config) if alias_of(plan, t.key)}
    features = (["per-expert-K"] if plan.profile.per_expert_k else []) + (["expert-aliases"] if aliases else [])
    return Manifest(
        tool={
            "name": "quantizer", "version": __version__, "torch": torch.__version__.split("+")[0],
            "exllamav3_target": EXLLAMAV3_TARGET, "exllamav3": _encoder_version(settings),
            "command": list(settings.command) if settings.command else None,
        },
        source={"path": str(ck.root), "revision": settings.revision, "arch": ck.config.arch,
                "fingerprint": source_fingerprint(ck),
                # the pack's config.json carries EXL3's quantization_config, not the source's FP8 grid
                "weight_block_size": list(ck.config.fp8_block),
                "base_model": settings.base_model, "license": source_license(ck.root),
                "quantization_config": _source_config(ck).get("quantization_config")},
        plan={"hash": plan.content_hash(), "loader": plan.profile.name, "codebook": plan.codebook,
              "head_bits": qcfg["head_bits"], "engram_dir": engram_dir} | ({"launch": launch} if launch else {})
        | ({"planned": settings.planned.to_dict()} if settings.planned else {}),
        settings=dict(settings.job_settings) | ({"tuning": settings.tuning} if settings.tuning else {})
        | ({"end_to_end": settings.end_to_end} if settings.end_to_end else {}),
        quantization=summary.quantization,
        shards=records,
        tensors=tensors,
        sources=sources,
        aliases=aliases,
        totals=summary.totals,
        loader_features=features,
        files=files,
    )


def _encoder_version(settings: PackSettings) -> str | None:
    """The exllamav3 that encoded the pack (GPU runs), read from package metadata without importing it."""
    if settings.job_settings.get("device") != "cuda":
        return None
    return metadata.version("exllamav3")
