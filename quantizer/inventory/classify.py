"""The inspect stage: every tensor classified, totals per class, and the checkpoint checked against
the tensors its config implies (names, shapes, dtypes) and its index (each tensor in the shard the
index names), from headers alone. A pack is not a native checkpoint: it is refused, pointing at verify."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantizer.checkpoint.source import INDEX_NAME, Checkpoint, is_engram_table
from quantizer.errors import UserError
from quantizer.model.layout import TensorSpec, native_layout
from quantizer.model.tensor_classes import CLASSES, ROUTED_EXPERT, VISION, classify
from quantizer.pack.manifest import is_pack
from quantizer.report import gib, table

EXAMPLES = 3


@dataclass
class ClassTotals:
    cls: str
    tensors: int = 0
    params: int = 0
    bytes: int = 0


@dataclass
class Inventory:
    source: str
    arch: str
    tensors: int
    params: int
    bytes: int
    classes: list[ClassTotals]
    routed_layers: int
    routed_experts_per_layer: int
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def render(self) -> str:
        """Tensors, parameters and bytes per class, then the problems (or that there are none)."""
        rows = [[c.cls, f"{c.tensors:,}", f"{c.params:,}", f"{c.bytes:,}", gib(c.bytes)] for c in self.classes]
        rows.append(["total", f"{self.tensors:,}", f"{self.params:,}", f"{self.bytes:,}", gib(self.bytes)])
        lines = [
            f"{self.source}  ({self.arch}; routed experts: {self.routed_layers} layers x {self.routed_experts_per_layer})",
            table(["class", "tensors", "params", "bytes", "GiB"], rows),
        ]
        if self.problems:
            lines += ["", f"{len(self.problems)} problem(s):"] + [f"  - {p}" for p in self.problems]
        else:
            lines += ["", "consistent with config.json: every implied tensor present with its shape and dtype"]
        return "\n".join(lines)


def take_inventory(ck: Checkpoint) -> Inventory:
    totals = {c: ClassTotals(c) for c in CLASSES}
    experts: dict[int, set[int]] = {}
    params = 0
    for name, e in ck.tensors.items():
        c = classify(name)
        spec = TensorSpec(name, e.shape, e.dtype)
        t = totals[c.cls]
        t.tensors += 1
        t.params += spec.params
        t.bytes += e.nbytes
        params += spec.params
        if c.cls == ROUTED_EXPERT:
            experts.setdefault(c.layer, set()).add(c.expert)
    return Inventory(
        source=str(ck.root),
        arch=ck.config.arch,
        tensors=len(ck.tensors),
        params=params,
        bytes=ck.payload_bytes,
        classes=[t for t in totals.values() if t.tensors],
        routed_layers=len(experts),
        routed_experts_per_layer=max((len(v) for v in experts.values()), default=0),
        problems=check_against_config(ck),
    )


def require_consistent(ck: Checkpoint) -> None:
    """UserError naming the first difference `inspect` would report: what a build checks before it
    spends hours on a checkpoint whose config does not describe its tensors."""
    problems = check_against_config(ck)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{ck.root}: does not match its config.json: {problems[0]}{more}; "
                        f"`quantizer inspect {ck.root}` lists every problem")


def check_against_config(ck: Checkpoint) -> list[str]:
    """Differences between the stored tensors and the layout the config implies."""
    # Vision tensor names are not published (see layout._vision), so vision is counted, not checked.
    expected = {
        s.name: s
        for s in native_layout(ck.config)
        if (ck.include_engram or not is_engram_table(s.name)) and classify(s.name).cls != VISION
    }
    problems = []
    missing = sorted(set(expected) - set(ck.tensors))
    extra = sorted(n for n in set(ck.tensors) - set(expected) if classify(n).cls != VISION)
    if missing:
        problems.append(f"{len(missing)} tensors the config implies are missing, e.g. {', '.join(missing[:EXAMPLES])}")
    if extra:
        problems.append(f"{len(extra)} tensors the config does not explain, e.g. {', '.join(extra[:EXAMPLES])}")
    for name in sorted(set(expected) & set(ck.tensors)):
        want, have = expected[name], ck.tensors[name]
        if tuple(have.shape) != want.shape or have.dtype != want.dtype:
            problems.append(
                f"{name}: stored as {have.dtype}{list(have.shape)}, config implies {want.dtype}{list(want.shape)}"
            )
    index = ck.root / INDEX_NAME
    if index.exists():
        data = json.loads(index.read_text())
        declared = data.get("metadata", {}).get("total_size")
        if declared is not None and ck.include_engram and int(declared) != ck.payload_bytes:
            problems.append(f"index total_size is {declared} but the shards hold {ck.payload_bytes} payload bytes")
        problems += _misplaced(ck, data.get("weight_map", {}))
    return problems


def _misplaced(ck: Checkpoint, weight_map: dict[str, str]) -> list[str]:
    """Tensors the index maps to a shard that does not hold them: a loader looks for them there."""
    wrong = sorted(n for n, e in ck.tensors.items() if weight_map.get(n, e.path.name) != e.path.name)
    if not wrong:
        return []
    first = wrong[0]
    return [f"{INDEX_NAME} maps {len(wrong)} tensor(s) to a shard that does not hold them, e.g. {first} to "
            f"{weight_map[first]} (it is in {ck.tensors[first].path.name}); the index and shards are from "
            "different downloads"]


def refuse_pack(root: Path) -> None:
    """UserError when `root` is an EXL3 pack, not a native checkpoint: its tensors are not the layout the
    config implies, so a list of differences would say nothing useful."""
    try:
        method = json.loads((root / "config.json").read_text()).get("quantization_config", {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        method = None
    if is_pack(root):
        raise UserError(f"{root}: this is an EXL3 pack written by quantizer, not a native checkpoint; "
                        f"use `quantizer verify {root}` (and `quantizer fit {root}`)")
    if method == "exl3":
        raise UserError(f"{root}: this is an EXL3 pack (config.json quantization_config: exl3), not a native "
                        "checkpoint; inspect reads the checkpoint it was made from")
