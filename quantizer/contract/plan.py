"""The plan: what K every EXL3 target gets, which cold experts alias warm ones, and the bytes that
follow. It is the contract between planning (uniform or allocator) and the quantize/pack stages.

K None means the tensor keeps its native storage; 16 means an unquantized fp16 linear. A plan is
made for one loader profile (loader_profiles.py), which it carries resolved; its file names it. The
rules a plan must keep and the bytes it implies are in rules.py (`make_plan`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from quantizer.contract.loader_profiles import LoaderProfile, load_profile
from quantizer.errors import UserError
from quantizer.workdir import read_json, write_json_atomic

FORMAT = "quantizer-plan"
VERSION = 2  # 2: `loader` (a profile name) replaces `mode`


@dataclass
class Plan:
    arch: str
    codebook: str
    profile: LoaderProfile  # the loader profile the plan satisfies; its name is what plan.json holds
    k: dict[str, float | None]  # every EXL3 target key of the model -> K, or None = native
    target_bpw: float | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # cold expert -> warm expert of its layer
    expected_bytes: dict[str, int] = field(default_factory=dict)  # per tensor class, plus totals
    achieved_bpw: float = 0.0  # exllamav3's `bits`: sum(numel*K)/sum(numel) over budgeted targets
    made_by: str = ""

    @property
    def head_bits(self) -> float | None:
        return self.k.get("head")

    def content_hash(self) -> str:
        """sha256 of what decides the pack's tensors: K map, aliases, codebook, loader, arch."""
        body = {"arch": self.arch, "codebook": self.codebook, "loader": self.profile.name,
                "k": self.k, "aliases": self.aliases}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    # ---- persistence -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "arch": self.arch, "codebook": self.codebook,
            "loader": self.profile.name, "target_bpw": self.target_bpw, "achieved_bpw": self.achieved_bpw,
            "head_bits": self.head_bits, "made_by": self.made_by, "content_hash": self.content_hash(),
            "expected_bytes": self.expected_bytes, "aliases": self.aliases, "k": self.k,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp name, then rename)."""
        path = Path(path)
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        data = read_json(path, "plan file not found", "write it again with `quantizer plan`")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UserError(f"{path}: not a quantizer plan (no \"format\": \"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise UserError(f"{path}: plan version {data.get('version')}; this quantizer reads version {VERSION}")
        try:
            plan = cls(
                arch=data["arch"], codebook=data["codebook"], profile=load_profile(data["loader"]),
                k={key: (None if v is None else float(v)) for key, v in data["k"].items()},
                target_bpw=data.get("target_bpw"), aliases=dict(data.get("aliases") or {}),
                expected_bytes={c: int(n) for c, n in (data.get("expected_bytes") or {}).items()},
                achieved_bpw=float(data.get("achieved_bpw", 0.0)), made_by=data.get("made_by", ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path}: malformed plan ({e}); write it again with `quantizer plan`")
        stored = data.get("content_hash")
        if stored and stored != plan.content_hash():
            raise UserError(f"{path}: content_hash does not match the K map (edited by hand?); "
                            "delete the content_hash field to accept the edit")
        return plan
