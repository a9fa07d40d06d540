"""The resume point of a calibration: every row chunk's hc streams and forward state after a layer.

One file per row chunk (each rank saves the chunks it runs), written atomically after the layer's
statistics; a layer is a resume point once all its chunks are saved, and the older point is deleted
only then. So a killed run, with any number of ranks, continues from the next layer with
bit-identical inputs. The forward state is saved field by field (tensors, dicts of tensors, dicts of
small dataclasses of tensors); a state field of any other kind is refused loudly rather than dropped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from quantizer.calibrate.storage import STREAMS_PREFIX
from quantizer.checkpoint.safetensors_file import planned, read_header, read_tensor, write_safetensors
from quantizer.errors import UserError
from quantizer.model import state as state_module
from quantizer.model.state import ForwardState

RESUME_KEY = "resume"
STREAMS_KEY = "resume.streams"  # no state field starts with "resume"
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


def chunk_file(next_layer: int, chunk: int) -> str:
    return f"{STREAMS_PREFIX}{next_layer:03d}_{chunk:04d}.safetensors"


def save_chunk(directory: Path, next_layer: int, chunk: int, part: Part) -> None:
    """One row chunk's streams and state before layer `next_layer`, atomically."""
    streams, state = part
    tensors: dict[str, torch.Tensor] = {STREAMS_KEY: streams}
    structure = {f.name: _flatten(f.name, getattr(state, f.name), tensors)
                 for f in dataclasses.fields(state) if f.name not in STATIC_FIELDS}
    meta = {"next_layer": next_layer, "chunk": chunk, "state": structure}
    write_safetensors(directory / chunk_file(next_layer, chunk), [planned(k, t) for k, t in tensors.items()],
                      metadata={RESUME_KEY: json.dumps(meta)})


def resume_point(directory: Path, chunks: int) -> int:
    """The first layer not run yet: the latest layer whose every row chunk is saved (0: none)."""
    saved: dict[int, set[int]] = {}
    for path in directory.glob(STREAMS_PREFIX + "*.safetensors"):
        layer, chunk = (int(x) for x in path.stem[len(STREAMS_PREFIX):].split("_"))
        saved.setdefault(layer, set()).add(chunk)
    return max((layer for layer, have in saved.items() if have >= set(range(chunks))), default=0)


def drop_resume_points(directory: Path, keep: int | None = None) -> None:
    """Delete every saved chunk but those before layer `keep`."""
    for path in directory.glob(STREAMS_PREFIX + "*"):
        if keep is None or not path.name.startswith(STREAMS_PREFIX + f"{keep:03d}_"):
            path.unlink(missing_ok=True)


def load_chunk(directory: Path, next_layer: int, chunk: int, start: ForwardState, device) -> Part:
    """(streams, state) of a saved row chunk; `start` is a fresh state of the same rows."""
    path = directory / chunk_file(next_layer, chunk)
    header = read_header(path)
    try:
        meta = json.loads(header.metadata[RESUME_KEY])
    except (KeyError, json.JSONDecodeError):
        raise UserError(f"{path}: not a calibration resume file; delete it to restart calibration") from None
    for name, spec in meta["state"].items():
        setattr(start, name, _unflatten(name, spec, header.tensors, device))
    return read_tensor(header.tensors[STREAMS_KEY]).to(device), start
