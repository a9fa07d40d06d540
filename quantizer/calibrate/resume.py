"""The resume point of a calibration: every row chunk's hc streams and forward state after a layer.

Saved atomically after each layer's statistics, so a killed run continues from the next layer with
bit-identical inputs. The forward state is saved field by field (tensors, dicts of tensors, dicts of
small dataclasses of tensors); a state field of any other kind is refused loudly rather than dropped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from quantizer.checkpoint.safetensors_file import planned, read_header, read_tensor, write_safetensors
from quantizer.errors import UserError
from quantizer.model import state as state_module
from quantizer.model.state import ForwardState

RESUME_KEY = "resume"
# Rebuilt from the token rows by ForwardState.start, so not saved.
STATIC_FIELDS = {"cfg", "tokens", "compute_dtype", "rope", "attn_chunk_elements"}

Part = tuple[torch.Tensor, ForwardState]  # (hc streams [rows, cols, n, D] float32, state) of one row chunk


def _flatten(prefix: str, value, tensors: dict[str, torch.Tensor]):
    """Put the tensors of one state field into `tensors`; return its structure as JSON."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value
        return "tensor"
    if isinstance(value, dict):
        return {str(k): _flatten(f"{prefix}.{k}", v, tensors) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        fields = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            fields[f.name] = {"int": v} if isinstance(v, int) else _flatten(f"{prefix}.{f.name}", v, tensors)
        return {"dataclass": type(value).__name__, "fields": fields}
    raise TypeError(f"cannot checkpoint a forward state value of type {type(value).__name__} ({prefix})")


def _unflatten(prefix: str, structure, tensors: dict, device):
    if structure is None:
        return None
    if structure == "tensor":
        return read_tensor(tensors[prefix]).to(device)
    if "dataclass" in structure:
        cls = getattr(state_module, structure["dataclass"])
        kwargs = {name: (spec["int"] if isinstance(spec, dict) and "int" in spec
                         else _unflatten(f"{prefix}.{name}", spec, tensors, device))
                  for name, spec in structure["fields"].items()}
        return cls(**kwargs)
    return {int(k): _unflatten(f"{prefix}.{k}", v, tensors, device) for k, v in structure.items()}


def save_streams(path: Path, parts: list[Part], next_layer: int) -> None:
    tensors: dict[str, torch.Tensor] = {}
    structures = []
    for i, (streams, state) in enumerate(parts):
        tensors[f"chunk.{i}.streams"] = streams
        structures.append({f.name: _flatten(f"chunk.{i}.{f.name}", getattr(state, f.name), tensors)
                           for f in dataclasses.fields(state) if f.name not in STATIC_FIELDS})
    meta = {"next_layer": next_layer, "chunks": structures}
    write_safetensors(path, [planned(k, t) for k, t in tensors.items()], metadata={RESUME_KEY: json.dumps(meta)})


def _resume_meta(path: Path) -> tuple[dict, object]:
    header = read_header(path)
    try:
        return json.loads(header.metadata[RESUME_KEY]), header
    except (KeyError, json.JSONDecodeError):
        raise UserError(f"{path}: not a calibration resume file; delete it to restart calibration") from None


def resume_layer(path: Path) -> int:
    """The first layer a resume file has not run yet."""
    return _resume_meta(path)[0]["next_layer"]


def load_streams(path: Path, starts: list[ForwardState], device) -> tuple[int, list[Part]]:
    """(next layer, parts) from a resume file; `starts` are fresh states of the same row chunks."""
    meta, header = _resume_meta(path)
    if len(meta["chunks"]) != len(starts):
        raise UserError(f"{path}: holds {len(meta['chunks'])} row chunks, this run has {len(starts)}; "
                        "delete it to restart")
    parts = []
    for i, (structure, state) in enumerate(zip(meta["chunks"], starts)):
        for name, spec in structure.items():
            setattr(state, name, _unflatten(f"chunk.{i}.{name}", spec, header.tensors, device))
        parts.append((read_tensor(header.tensors[f"chunk.{i}.streams"]).to(device), state))
    return meta["next_layer"], parts
