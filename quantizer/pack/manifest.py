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
  quantization_config.json, the tokenizer and generation files of the source, what a loader profile
  adds) -> {bytes, sha256}; with the shards, manifest.json and README.md these are all the files the
  pack owns (pack/owned.py), so verify and publish know a stray from a file of the pack;
- `measurement`: what `quantizer ppl PACK --against SRC --record` measured (pack/measurement.py), or null;
- `claims_sha256`: the sha256 of every key above, so a hand edit of any claim (where the pack came from,
  how it was made, its bpw, K map, aliases, files, measurement) is found by verify and refused by
  `card` and `ppl --record`, which rewrite the digest only of a manifest whose digest checks.

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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from quantizer.checkpoint.fingerprint import sha256_file
from quantizer.contract.loader_profiles import LoaderProfile, load_profile, loader_names
from quantizer.errors import UserError
from quantizer.pack.measurement import Measurement
from quantizer.workdir import read_json

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 3  # 2: plan.profile.name (a profile name) replaces plan.loader_mode; 3: files, the digest covers all
NATIVE = "native"


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

    def require_files(self, pack: Path) -> None:
        """UserError naming the first recorded file (index, configs, tokenizer, launch settings) that is not as
        written: a command that reads the pack would otherwise use an edited file without a word."""
        for name in self.files:
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
            data[f.name] = asdict(value) if f.name == "measurement" and value is not None else value
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
        """UserError unless the claims check: nothing may be stated, measured or signed off from claims
        that were edited by hand."""
        problem = self.claims_problem()
        if problem:
            raise UserError(f"{where}: {problem}; rebuild the pack, or copy it again from where it was built")

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

    def exl3_keys(self) -> dict[str, float | int]:
        """EXL3 linear key -> K, from the `.trellis` tensors the manifest lists."""
        return {n[: -len(".trellis")]: t.K for n, t in self.tensors.items() if n.endswith(".trellis")}


def is_pack(path: str | Path) -> bool:
    """Whether `path` is a pack quantizer wrote (a directory with a manifest), not a native checkpoint."""
    return (Path(path) / MANIFEST_NAME).is_file()


def _digest(claims: dict) -> str:
    body = json.dumps(claims, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(body.encode()).hexdigest()

