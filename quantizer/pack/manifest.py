"""`manifest.json`: what a pack claims about itself, written by the pack stage and checked by verify.

Schema (manifest_version 3):

- `tool`: name, version, torch, `exllamav3_target` (the format version the pack is written for),
  `exllamav3` (the version that encoded it on the GPU, or null for the CPU codec) and `command` (the
  build command line with `--out PACK`, or null; the card gives it as the way to rebuild);
- `source`: path, revision, arch, fingerprint and FP8 `weight_block_size` of the native checkpoint (the
  pack's own config.json carries EXL3's quantization_config, so verify reads the source grid here),
  `base_model` (its Hugging Face repo id, or null) and `license` (from its card's front matter, or null);
- `plan`: hash, loader (the loader profile the pack is made for; verify checks it), codebook, head_bits,
  `engram_dir` where the profile keeps the tables beside the pack (its shards, each one's bytes and sha256)
  and `launch` where the engine maps weights (launch.env's settings);
  `settings`: seed, device, encoder, calibration, and `tuning` when the tune stage ran (its settings,
  the tuning / held-out row split and each block's held-out error ratio, tuned over stored scales);
- `quantization`: the integer `bits`, the `bpw` and the K histogram written into config.json;
- `shards`: [{file, bytes, sha256, engram}] in file order;
- `tensors`: every tensor in the shards (alignment pads excepted) -> {shard, K, class}; K is the
  linear's bits per weight (16 for an fp16 linear) or "native" for a pass-through tensor;
- `sources`: every source tensor -> "native" (passed through unchanged), {"exl3": [keys]} (replaced
  by those EXL3 linears; a fused wo_a by its exllamav3 slices), {"fp16": key} (K 16: an unquantized
  fp16 weight) or {"alias": key} (a cold expert served by another expert's tensors);
- `aliases`: EXL3 key -> the key whose tensors stand in for it;
- `totals`: per tensor class {tensors, bytes, params, bpw} (bpw = stored bits per source parameter);
- `loader_features`: what a loader must support ("per-expert-K", "expert-aliases");
- `files`: every other file the pack stage wrote or copied into the pack (index, config.json,
  quantization_config.json, k_map.json, the tokenizer and generation files of the source, what a loader
  profile adds) -> {bytes, sha256}; with the shards, manifest.json and README.md these are all the files the
  pack owns (pack/owned.py), so verify and publish know a stray from a file of the pack;
- `measurement`: what `quantizer ppl PACK --against SRC --record` measured (pack/measurement.py), or null;
- `claims_sha256`: the sha256 of every key above, so a hand edit of any claim (where the pack came from,
  how it was made, its bpw, K map, aliases, files, measurement) is found by verify and refused by
  `card` and `ppl --record`, which rewrite the digest only of a manifest whose digest checks.

A digest proves only that nobody edited the claims without making it again, and the library's own
`Manifest.to_dict` makes it again. So what the manifest sums up of the pack (`quantization`, `plan.head_bits`,
`totals`, each tensor's K and class; `Summary`) and k_map.json (every stored linear -> K, 16 for fp16, or
"source") are recomputed by `summarise`, the function the pack stage wrote them with, from the plan the
shards carry (`held_plan`: K from each trellis width, docs/exl3-format.md): verify faults a difference, and
`require_claims` (`card`, `ppl`, `eval`, `fit PACK`) refuses it, as it refuses launch.env settings other than the claimed.

Version 2 manifests (before `files`, and with a digest of tool, source, plan and settings only) are
refused with one line saying to rebuild: what they claim about the rest cannot be vouched for.

No fit verdict: whether a pack fits N Sparks depends on the hardware profile (configs/hardware/gb10.json),
which is re-measured, so a stored verdict would go stale. The shards' headers are its inputs, and
`quantizer fit PACK` (or quantizer.pack.fit_table.pack_fit_table) computes it against today's profile. A `fit`
written by an older version is ignored when read.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.fingerprint import sha256_file
from quantizer.checkpoint.safetensors_file import PAD_PREFIX, TensorEntry, read_header
from quantizer.contract.loader_profiles import LoaderProfile, load_profile, loader_names
from quantizer.contract.pack_spec import StoredTensor, expert_of, pack_spec
from quantizer.contract.plan import Plan
from quantizer.contract.rules import achieved_bpw
from quantizer.contract.stored_linear import StoredLinear
from quantizer.errors import UserError
from quantizer.exl3 import UNQUANTIZED, Codebook, k_from_trellis, parse_codebook
from quantizer.fit.launch import read_launch
from quantizer.model.targets import classified_layout, target_map
from quantizer.pack.exl3_config import quantization_config
from quantizer.pack.measurement import Measurement
from quantizer.workdir import read_json

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 3  # 2: plan.profile.name (a profile name) replaces plan.loader_mode; 3: files, the digest covers all
NATIVE = "native"
K_MAP_NAME = "k_map.json"  # every stored linear -> its K, or SOURCE_FORM (written by the pack stage, checked by verify)
SOURCE_FORM = "source"


@dataclass(frozen=True)
class ShardRecord:
    file: str
    bytes: int
    sha256: str
    engram: bool = False


@dataclass(frozen=True)
class FileRecord:
    bytes: int
    sha256: str


@dataclass(frozen=True)
class TensorRecord:
    shard: str
    K: float | int | str  # EXL3 bits per weight of the linear it belongs to, or "native"
    cls: str


@dataclass
class Manifest:
    tool: dict
    source: dict
    plan: dict
    settings: dict
    quantization: dict
    shards: list[ShardRecord]
    tensors: dict[str, TensorRecord]
    sources: dict[str, object]
    aliases: dict[str, str] = field(default_factory=dict)
    totals: dict[str, dict] = field(default_factory=dict)
    loader_features: list[str] = field(default_factory=list)
    files: dict[str, FileRecord] = field(default_factory=dict)
    measurement: Measurement | None = None  # pack/measurement.py: set by `ppl --record` only
    claims_sha256: str | None = None  # as read; to_dict writes the digest of the claims it holds
    profile: LoaderProfile = field(init=False, repr=False, compare=False)  # plan["loader"], resolved on load

    def __post_init__(self):
        self.profile = load_profile(self.plan["loader"])

    def file_problem(self, pack: Path, name: str) -> str | None:
        """Why the pack's recorded file `name` is not the one the pack stage wrote (missing, or its size or
        sha256 differs), or None. verify, and every command that reads such a file, ask here first."""
        record, path = self.files[name], Path(pack) / name
        if not path.is_file():
            return "missing; the pack stage wrote it"
        if path.stat().st_size != record.bytes or sha256_file(path) != record.sha256:
            return "not the file the pack stage wrote (its size or sha256 differs from the manifest's)"
        return None

    def require_files(self, pack: Path, names: tuple[str | None, ...] | None = None) -> None:
        """UserError naming the first recorded file (index, configs, tokenizer, launch settings; of `names` only,
        where given) that is not as written: a command that reads the pack would otherwise use an edited file
        without a word."""
        for name in self.files if names is None else [n for n in names if n in self.files]:
            problem = self.file_problem(pack, name)
            if problem:
                raise UserError(f"{Path(pack) / name}: {problem}; copy the pack again, or rebuild it "
                                f"(`quantizer verify --full {pack}` lists every fault)")

    def to_dict(self) -> dict:
        data = self._claims()
        data["claims_sha256"] = _digest(data)
        return data

    def _claims(self) -> dict:
        """Every key of manifest.json but the digest, as written."""
        data = {"manifest_version": MANIFEST_VERSION}
        for f in fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            data[f.name] = value.to_dict() if f.name == "measurement" and value is not None else value
        data["shards"] = [asdict(s) for s in self.shards]
        data["tensors"] = {n: {"shard": t.shard, "K": t.K, "class": t.cls} for n, t in self.tensors.items()}
        data["files"] = {n: asdict(r) for n, r in self.files.items()}
        del data["claims_sha256"]
        return data

    def claims_digest(self) -> str:
        """sha256 of every claim as it is now."""
        return _digest(self._claims())

    def claims_problem(self) -> str | None:
        """Why the manifest's claims cannot be vouched for (None: they are as the pack stage, or
        `ppl --record`, wrote them)."""
        if self.claims_sha256 is None:
            return "has no claims_sha256, so nothing it claims can be vouched for"
        if self.claims_sha256 != self.claims_digest():
            return ("was edited after packing (its claims_sha256 does not match what it claims: source, plan, "
                    "settings, bpw, K, aliases, files or measurement)")
        return None

    def require_claims(self, where: str | Path) -> None:
        """UserError unless the claims check (`where`: the pack's manifest.json): nothing may be stated, measured
        or signed off from claims that were edited by hand, nor from a summary (bpw, K histogram, totals) the
        pack's shards do not give, even under a digest made again for it."""
        problem = self.claims_problem()
        if problem:
            raise UserError(f"{where}: {problem}; rebuild the pack, or copy it again from where it was built")
        pack = Path(where).parent
        launch = (self.plan.get("launch") or {}).get("file")
        self.require_files(pack, ("config.json", launch))  # what the summary and launch claims are checked against
        cfg = self.model_config(pack)
        entries = {n: e for s in self.shards for n, e in read_header(pack / s.file).tensors.items()}
        wrong = self.summary_faults(summarise(cfg, held_plan(cfg, self, entries), stored_bytes(entries)))
        if wrong:
            more = f" (and {len(wrong) - 1} more claim(s); `quantizer verify {pack}` lists them)" if len(wrong) > 1 else ""
            raise UserError(f"{where}: {wrong[0]}{more}; rebuild the pack, or copy it again from where it was built")
        problem = self.launch_problem(pack)
        if problem:
            where = pack / launch
            problem = problem.removeprefix(f"{where}: ")
            raise UserError(f"{where}: {problem}; rebuild the pack, or copy it again from where it was built")

    def summary_faults(self, summary: "Summary") -> list[str]:
        """One line per summarising claim (bpw, bits, K histogram, head bits, each class's totals, each tensor's K
        and class) that is not what the pack's plan and shards give (`summary`)."""
        claims = [("bpw", self.quantization.get("bpw"), summary.quantization["bpw"]),
                  ("bits", self.quantization.get("bits"), summary.quantization["bits"]),
                  ("k_histogram", self.quantization.get("k_histogram"), summary.quantization["k_histogram"]),
                  ("head_bits", self.plan.get("head_bits"), summary.head_bits)]
        claims += [(f"totals[{cls}]", self.totals.get(cls), summary.totals.get(cls))
                   for cls in sorted(set(self.totals) | set(summary.totals))]
        out = [f"{name} claims {_shown(claimed)}, the plan and shards give {_shown(actual)}"
               for name, claimed, actual in claims if claimed != actual]
        tensors = {n: (t.K, t.cls) for n, t in self.tensors.items()}
        wrong = sorted(n for n, held in summary.tensors.items() if n in tensors and tensors[n] != held)
        if wrong:
            (k, cls), (real_k, real_cls) = tensors[wrong[0]], summary.tensors[wrong[0]]
            out.append(f"tensors: {len(wrong)} record(s) differ from the shards, e.g. {wrong[0]} claims K {k} "
                       f"({cls}), the plan and shards give K {real_k} ({real_cls})")
        return out

    def launch_problem(self, pack: Path) -> str | None:
        """Why the pack's launch.env is not what the manifest's `plan.launch` claims (missing, unreadable, another
        DRAFT, CTX or CHUNK), or None (also for a pack without launch settings)."""
        launch = self.plan.get("launch")
        if not launch:
            return None
        try:
            found = read_launch(pack)
        except UserError as e:
            return str(e)
        if found is None:
            return "missing; the engine's launch settings (copy pattern, drafter) are not in the pack"
        if found.drafter != launch.get("drafter", True):
            return (f"DRAFT={int(found.drafter)}, but the pack's drafter is "
                    f"{'EXL3' if launch.get('drafter', True) else 'in source form'}")
        if found.context != launch.get("context"):
            return f"CTX={found.context}, but the pack was fitted for {launch.get('context')} tokens"
        if found.chunk != launch.get("chunk"):
            return f"CHUNK={found.chunk}, but the manifest claims {launch.get('chunk')}"
        return None

    def model_config(self, pack: Path) -> ModelConfig:
        """The model's config from the pack's config.json, with the source's FP8 block grid (kept here: the
        pack's own quantization_config is EXL3's); UserError when unreadable."""
        cfg = ModelConfig.from_file(Path(pack) / "config.json")
        block = self.source.get("weight_block_size")
        return replace(cfg, fp8_block=tuple(block)) if block else cfg

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "Manifest":
        try:
            version = data.pop("manifest_version")
            data.pop("fit", None)  # a verdict older versions stored; stale by design (module docstring)
            if version == 2:
                raise UserError(f"{where}: manifest_version 2, written before packs recorded the files they own and "
                                "the digest covered every claim; rebuild the pack with this quantizer (a build into a "
                                "new --out with the old --work repacks without encoding again)")
            if version != MANIFEST_VERSION:
                raise UserError(f"{where}: manifest_version {version} is not {MANIFEST_VERSION}; use a matching quantizer")
            if data["plan"]["loader"] not in loader_names():
                raise UserError(f"{where}: made for loader profile {data['plan']['loader']!r}, which this quantizer "
                                f"does not know ({', '.join(loader_names())}); use the quantizer that wrote it")
            data["shards"] = [ShardRecord(**s) for s in data["shards"]]
            data["files"] = {n: FileRecord(**r) for n, r in data.get("files", {}).items()}
            data["tensors"] = {n: TensorRecord(t["shard"], t["K"], t["class"]) for n, t in data["tensors"].items()}
            if data.get("measurement") is not None:
                data["measurement"] = Measurement.from_dict(data["measurement"])
            return cls(**data)
        except (KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{where}: not a valid pack manifest ({type(e).__name__}: {e}); rebuild the pack")

    @classmethod
    def load(cls, pack: Path) -> "Manifest":
        path = Path(pack) / MANIFEST_NAME
        data = read_json(path, "no manifest; this is not a pack written by quantizer (or it is incomplete)",
                         "the manifest is corrupt")
        return cls.from_dict(data, str(path))

    @property
    def planned(self) -> "Planned | None":
        """The Spark count, context and streams the build fitted this pack to (build's --sparks, --context,
        --streams); for a one-Spark pack written before that was recorded, its launch.env's context. None where
        the build named no Spark count."""
        given = self.plan.get("planned")
        launch = self.plan.get("launch") or {}
        try:
            if given:
                return Planned(int(given["sparks"]), int(given["context"]), int(given["streams"]))
            return Planned(1, int(launch["context"]), 1) if launch.get("context") else None
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{MANIFEST_NAME}: plan.planned {given!r} is not the Sparks, context and streams a build "
                            "records; rebuild the pack, or copy it again from where it was built") from None

    def exl3_keys(self) -> dict[str, float | int]:
        """EXL3 linear key -> K, from the `.trellis` tensors the manifest lists."""
        return {n[: -len(".trellis")]: t.K for n, t in self.tensors.items() if n.endswith(".trellis")}


@dataclass(frozen=True)
class Planned:
    """What a pack was fitted to at build time: fit and the card answer at it first (issue 61)."""
    sparks: int
    context: int  # tokens per stream
    streams: int

    def to_dict(self) -> dict:
        return {"sparks": self.sparks, "context": self.context, "streams": self.streams}


@dataclass(frozen=True)
class Summary:
    """What a manifest (and k_map.json) sums up of a pack, computed from its plan and the tensors of its
    directory: by the pack stage to write it, by verify, `card` and `ppl` from the plan the shards carry."""

    quantization: dict  # bits, bpw (exllamav3's record, as config.json's), k_histogram
    head_bits: float | int
    totals: dict[str, dict]  # per tensor class: tensors, bytes, params, bpw
    tensors: dict[str, tuple]  # every tensor of the pack directory -> (K, class), as the manifest's `tensors`
    k_map: dict[str, float | int | str]  # k_map.json: every stored linear -> K (16: fp16) or SOURCE_FORM


def summarise(cfg: ModelConfig, plan: Plan, stored: Mapping[str, int]) -> Summary:
    """The summary of a pack of `plan` whose directory holds `stored` (tensor name -> bytes); a tensor of the
    plan's spec that `stored` lacks counts at the spec's size (verify's layout check faults it, once)."""
    spec = pack_spec(cfg, plan)
    linears = {s.key: s for s in spec.linears}
    held = spec.model_dir
    params: Counter = Counter()
    for tensor, cls in classified_layout(cfg):
        params[cls] += tensor.params
    count: Counter = Counter()
    nbytes: Counter = Counter()
    for t in held:
        count[t.cls] += 1
        nbytes[t.cls] += stored.get(t.name, t.nbytes)
    totals = {cls: {"tensors": count[cls], "bytes": nbytes[cls], "params": params[cls],
                    "bpw": round(8 * nbytes[cls] / params[cls], 4) if params[cls] else None} for cls in sorted(count)}
    head = head_bits(plan)
    record = quantization_config({}, achieved_bpw(cfg, plan), head, parse_codebook(plan.codebook), None)
    histogram = Counter(f"{s.K:g}" for s in spec.encoded)
    return Summary(
        quantization={"bits": record["bits"], "bpw": record["bpw"],
                      "k_histogram": dict(sorted(histogram.items(), key=lambda kv: float(kv[0])))},
        head_bits=head, totals=totals,
        tensors={t.name: (tensor_k(t, linears), t.cls) for t in held},
        k_map={s.key: SOURCE_FORM if s.K is None else record_k(s.K) for s in spec.linears},
    )


def tensor_k(t: StoredTensor, linears: Mapping[str, StoredLinear]) -> float | int | str:
    """The K the manifest records for a tensor of the pack: its linear's (16: fp16), or NATIVE."""
    return NATIVE if t.linear is None else record_k(linears[t.linear].K)


def record_k(k: float) -> float | int:
    """K as the manifest and k_map.json write it (2, not 2.0)."""
    return int(k) if float(k).is_integer() else float(k)


def head_bits(plan: Plan) -> float | int:
    """K of the head; 16 (exllamav3's "unquantized") when it stays native or fp16."""
    return record_k(plan.head_bits if plan.head_bits is not None else UNQUANTIZED)


def held_plan(cfg: ModelConfig, manifest: Manifest, entries: Mapping[str, TensorEntry]) -> Plan:
    """The plan the shards carry: each target's K read from its stored tensors (`held_k`), the manifest's aliases
    (verify checks each against the shards)."""
    k: dict[str, float | None] = {}
    for key in target_map(cfg):
        held = manifest.aliases.get(key, key)
        first = held if f"{held}.trellis" in entries or f"{held}.weight" in entries else f"{held}.slice.0"
        k[key] = held_k(first, entries)[0]
    aliases = {expert_of(cold): expert_of(warm) for cold, warm in manifest.aliases.items()}
    return Plan(cfg.arch, manifest.plan["codebook"], manifest.profile, k, aliases=aliases)


def held_k(key: str, entries: Mapping[str, TensorEntry]) -> tuple[float | None, str | None]:
    """(K, codebook) of a stored linear: from its trellis width (docs/exl3-format.md) and marker; 16 for an
    fp16 weight; (None, None) for native storage."""
    trellis = entries.get(f"{key}.trellis")
    if trellis is not None and len(trellis.shape) == 3:
        marker = next((cb.value for cb in (Codebook.MUL1, Codebook.MCG) if f"{key}.{cb.value}" in entries),
                      Codebook.INST3.value)
        return k_from_trellis(trellis.shape), marker
    weight = entries.get(f"{key}.weight")
    if weight is not None and weight.dtype == "F16" and f"{key}.scale" not in entries:
        return UNQUANTIZED, None
    return None, None


def stored_bytes(entries: Mapping[str, TensorEntry]) -> dict[str, int]:
    """Tensor name -> bytes of the shards' tensors, alignment pads left out."""
    return {n: e.nbytes for n, e in entries.items() if not n.startswith(PAD_PREFIX)}


def _shown(value) -> str:
    return "none" if value is None else json.dumps(value, sort_keys=True) if isinstance(value, dict) else f"{value}"


def is_pack(path: str | Path) -> bool:
    """Whether `path` is a pack quantizer wrote (a directory with a manifest), not a native checkpoint."""
    return (Path(path) / MANIFEST_NAME).is_file()


def _digest(claims: dict) -> str:
    body = json.dumps(claims, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()

