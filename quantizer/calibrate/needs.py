"""Memory and disk a calibration run needs, stated before it starts.

Device memory is the highest of the moments the run goes through, each counted as what is alive
then (bench/calibrate_memory.py meters each on the CPU and prints it beside this estimate):
  layer L, loading         the hc streams and state of all rows (every moment has them) + block L's
                           weights, as loaded in its order, with one tensor's dequantization workspace
  layer L, in the block    weights + the float64 Hessian sums of its groups (collect.py says why) +
                           the MoE inputs kept so far (see below) + one
                           row chunk's tensors at the block's peak moments (streaming.block_activations:
                           Engram, attention, MoE, then collect.py's site gains and its check)
  layer L, expert inputs   (--expert-hessians other than shared) weights + kept inputs + the sums +
                           every token's MoE input and routing, kept through the rows, while the
                           experts' own gate/up Hessians are made one at a time (collect.py): one
                           expert's float64 sum, the prior, the float32 mean and its packing
  layer L, finishing       weights + kept inputs + the sums turning into float32 means, then the
                           Cholesky and energy workspaces of the largest group / linear
  head                     the head weight twice (the model's and the one read for its statistics)
                           + its sums, mean and energy workspace
The last layer's packed Hessians outlive it (stage.py keeps its result until the next one replaces
it; host memory on CUDA): they count in the next moments. Kept inputs are at most alias_tokens of
each expert's routed tokens and sample_tokens of all tokens.
ram on CUDA = the host's staging, the largest of: a tensor read from disk before it moves to the
  device (block tensors; embed and head), the packed Hessians being made beside the last layer's,
  one layer file plus the bytes of its largest part while it is written, one row chunk's streams
  and state copied to the host and to bytes for the resume file (models of more than one layer).
ram on the CPU = the device moments above, or a write with its bytes copies, whichever is higher.
disk = every layer file + the head file + the resume file twice (old and new while it is replaced);
  once complete the resume file is deleted. A layer file holds per group in * 4 (diagonal) +
  in * (in + 1) / 2 * (4, or 2 for float16 routed groups) bytes. With --expert-hessians other than
  shared every routed expert adds a hidden_size-wide group (its own gate/up input) to the files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantizer.calibrate.analysis import ENERGY_ROWS
from quantizer.calibrate.groups import head_group, layer_groups
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.caches import process_cache
from quantizer.calibrate.storage import STORAGE_DTYPES
from quantizer.checkpoint.config import ModelConfig
from quantizer.model.block import Block
from quantizer.model.state import DEFAULT_ATTN_CHUNK_ELEMENTS
from quantizer.model.streaming import MemoryEstimate, block_activations, block_weight_bytes, state_bytes
from quantizer.model.targets import classified_layout, targets
from quantizer.model.tensor_classes import ENGRAM_TABLE
from quantizer.report import GIB, gib


@dataclass(frozen=True)
class CalibrationNeeds:
    stream: MemoryEstimate  # at the device peak: weights, states, one chunk's tensors (and where)
    hessians: int  # the float64 sums alive then (finishing a layer: sums, means and workspace)
    extras: int  # kept MoE inputs and, on the CPU, packed Hessians then
    ram_staging: int  # host memory for reads and writes on CUDA
    cpu_ram: int  # host memory of a run on the CPU
    layer_files: int  # all layer files and the head file
    resume_file: int
    moments: tuple[tuple[str, int], ...] = ()  # device bytes at every moment, e.g. ("layer 0 moe", n)

    @property
    def device(self) -> int:
        return self.stream.total + self.hessians + self.extras

    def ram(self, device: str) -> int:
        return self.cpu_ram if device == "cpu" else self.ram_staging

    @property
    def disk(self) -> int:
        return self.layer_files + 2 * self.resume_file

    def describe(self, device: str) -> str:
        where = "RAM" if device == "cpu" else "GPU memory"
        text = (f"calibrate needs ~{_size(self.ram(device) if device == 'cpu' else self.device)} {where} "
                f"(at its peak, {self.stream.moment}: weights {_size(self.stream.weights)} + streams and state "
                f"{_size(self.stream.states)} + activations {_size(self.stream.activations)} + Hessian sums "
                f"{_size(self.hessians)} + kept inputs and packed Hessians {_size(self.extras)})")
        if device != "cpu":
            text += f", ~{_size(self.ram_staging)} RAM"
        return (text + f", ~{_size(self.disk)} disk while running ({_size(self.layer_files)} Hessians kept + "
                f"twice the resume point of {_size(self.resume_file)}, rewritten after each layer)")


def _size(n: int) -> str:
    return f"{gib(n)} GiB" if n >= GIB else f"{n / (1 << 20):,.1f} MiB"


def stored_bytes(size: int, dtype: torch.dtype) -> int:
    return size * 4 + size * (size + 1) // 2 * dtype.itemsize


def _energy_workspace(cfg: ModelConfig, prefix: str, item: int) -> int:
    """analysis.out_energy's largest workspace over the linears under `prefix`: a block of up to
    ENERGY_ROWS weight rows in float32 (a copy unless the model is float32), its product with H and
    that times the rows."""
    widths = [min(t.out_features, ENERGY_ROWS) * t.in_features for t in targets(cfg) if t.key.startswith(prefix)]
    return max(widths, default=0) * (8 + (4 if item != 4 else 0))


def _nbytes(layout: dict, name: str) -> int:
    return layout[name].nbytes if name in layout else 0


def _dequant_workspace(spec, item: int) -> int:
    """checkpoint/dequant.py's peak while one stored tensor becomes the model dtype: its stored bytes,
    then for FP8 the float32 values, block scales and their product (12 bytes per weight); for
    MXFP4 the unpacking's int64 nibbles and codes (16) before the float32 values (4); else a cast."""
    per = {"F8_E4M3": 12, "I8": 20}.get(spec.dtype)
    if per is None:
        return spec.nbytes if spec.nbytes // max(spec.params, 1) != item else 0
    return spec.nbytes + per * spec.params


def _loading(cfg: ModelConfig, layer: int, kind: int, dtype: torch.dtype, layout: dict) -> tuple[int, int]:
    """(device bytes, host bytes) at the peak of load_block: the block's tensors load in its own order,
    each dequantized beside those before it; the host holds one stored tensor at a time. `kind`: the first
    layer that stores the same tensors (_layer_kinds), whose block is built for it."""
    loaded = peak = read = 0
    for key, nbytes in _block_tensors(cfg, kind, dtype):
        spec = layout.get(f"layers.{layer}.{key}")
        if spec is None:  # an Engram table: rows are read per forward
            continue
        peak = max(peak, loaded + _dequant_workspace(spec, dtype.itemsize))
        read = max(read, spec.nbytes)
        loaded += nbytes
    return max(peak, loaded), read


def _layer_kinds(layout: dict, num_layers: int) -> list[int]:
    """Per layer, the first layer that stores the same tensors (names within the layer, dtypes, shapes):
    layers that store the same tensors build the same block."""
    stored: dict[int, list] = {layer: [] for layer in range(num_layers)}
    for name, spec in layout.items():
        parts = name.split(".", 2)
        if parts[0] == "layers" and int(parts[1]) in stored:
            stored[int(parts[1])].append((parts[2], spec.dtype, tuple(spec.shape)))
    first: dict[tuple, int] = {}
    return [first.setdefault(tuple(sorted(stored[layer])), layer) for layer in range(num_layers)]


@process_cache(maxsize=64)
def _block_tensors(cfg: ModelConfig, layer: int, dtype: torch.dtype) -> tuple[tuple[str, int], ...]:
    """(key, bytes) of a block's tensors in load order, built on the meta device once per kind of layer:
    a real model's 40 layers are six kinds, and building 384 experts a layer was most of the
    statement's time."""
    with torch.device("meta"):
        block = Block(cfg, layer, dtype)
    return tuple((key, t.nbytes) for key, t in block.state_dict().items())


def calibration_needs(cfg: ModelConfig, rows: int, cols: int, settings: CalibrationSettings) -> CalibrationNeeds:
    """The moments of the module docstring, for `rows` x `cols` tokens under `settings`."""
    dtype, cuda = settings.dtype, settings.device == "cuda"
    item = dtype.itemsize
    chunk = settings.chunk_rows(rows, cols)
    weights = block_weight_bytes(cfg, dtype)
    streams, other = state_bytes(cfg, rows, cols)
    states = streams + other
    tokens = rows * cols  # kept inputs: up to alias_tokens per expert of its routed tokens, sample_tokens of all
    kept = (min(cfg.experts_in("layers") * settings.alias_tokens, tokens * cfg.experts_per_token)
            + min(settings.sample_tokens, tokens)) * cfg.hidden_size * item
    expert_dtype = STORAGE_DTYPES[settings.expert_hessian_dtype]
    layout = {spec.name: spec for spec, cls in classified_layout(cfg) if cls != ENGRAM_TABLE}
    # per moment: (weights, states, activations), sums or finishing workspace, other calibration tensors
    # on the device, and the host's staging then (CUDA)
    moments: list[tuple[MemoryEstimate, int, int, int]] = []
    files: list[int] = []
    writing = 0
    kinds = _layer_kinds(layout, cfg.num_layers)
    for layer in range(cfg.num_layers):
        groups = layer_groups(cfg, layer, settings.expert_inputs)
        block = weights.get(f"layers.{layer}", 0)
        sums = sum(8 * g.size ** 2 for g in groups if not g.expert_input)
        parts = [stored_bytes(g.size, expert_dtype if g.routed else torch.float32) for g in groups]
        own = [stored_bytes(g.size, expert_dtype) for g in groups if g.expert_input]  # none where no expert is a target
        # kept for the experts' own inputs: every token's MoE input, expert ids (int64) and w^p (float32)
        routing = tokens * (cfg.hidden_size * item + cfg.experts_per_token * 12) if own else 0
        before = files[-1] if files else 0  # the last layer's packed Hessians, alive until its successor's
        held = 0 if cuda else before
        loaded, read = _loading(cfg, layer, kinds[layer], dtype, layout)
        moments.append((MemoryEstimate(0, states, loaded, f"layer {layer} loading"), 0, held, before + read))
        acts = block_activations(cfg, layer, chunk, cols, dtype, DEFAULT_ATTN_CHUNK_ELEMENTS, cuda, hooked=True,
                                 all_experts=settings.all_experts)
        for name, act in acts.items():
            moments.append((MemoryEstimate(block, states, act, f"layer {layer} {name}"), sums, kept + routing + held,
                            before))
        own_packed = 0 if cuda else sum(own)  # on the host with CUDA
        if own:  # one expert's sum and the prior (float64), its mean, the packing's product, mask and triangle,
            # beside each chunk's pairs sorted by expert (int64)
            square = cfg.hidden_size ** 2
            making = sums + 29 * square + tokens * cfg.experts_per_token * 8
            moments.append((MemoryEstimate(block, states, 0, f"layer {layer} expert inputs"), making,
                            kept + routing + held + own_packed, before + sum(own)))
        widest = 4 * max((g.size ** 2 for g in groups if not g.expert_input), default=0)
        finishing = max(sums + widest, sums // 2 + 5 * widest,
                        sums // 2 + _energy_workspace(cfg, f"layers.{layer}.", item))
        packed = sum(parts)  # made as the means go, so never above them on the device
        moments.append((MemoryEstimate(block, states, 0, f"layer {layer} finishing"), finishing,
                        kept + held + own_packed, before + packed))
        files.append(packed)
        writing = max(writing, packed + max(parts, default=0))  # the file's tensors and one's bytes copy
    head = head_group(cfg)
    root = sum(v for k, v in weights.items() if not k.startswith(("layers", "embed")))
    last = files[-1] if files else 0
    if head is not None:
        workspace = 12 * head.size ** 2 + _energy_workspace(cfg, "head", item)  # sums, mean, energy
        held = 0 if cuda else last
        moments.append((MemoryEstimate(root + weights.get("head.weight", 0), states, 0, "head"), workspace, held,
                        last + _nbytes(layout, "head.weight")))
    moments.append((MemoryEstimate(weights.get("embed.weight", 0), states, 0, "embedding"), 0, 0,
                    _nbytes(layout, "embed.weight")))
    peak, sums, extras, _ = max(moments, key=lambda m: m[0].total + m[1] + m[2])
    head_file = stored_bytes(head.size, torch.float32) if head else 0
    chunk_part = states * chunk // rows  # one row chunk's resume file
    resuming = last + 2 * chunk_part if cfg.num_layers > 1 else 0  # a host copy and its bytes (CUDA)
    staging = max([m[3] for m in moments] + [writing, resuming])
    device = peak.total + sums + extras
    block_max = max((weights.get(f"layers.{layer}", 0) for layer in range(cfg.num_layers)), default=0)
    cpu_writing = block_max + states + kept + writing
    cpu_resuming = states + last + chunk_part if cfg.num_layers > 1 else 0  # the bytes copy of a chunk
    cpu_ram = max(device, cpu_writing, cpu_resuming)
    named = tuple((m.moment, m.total + s + e) for m, s, e, _ in moments)
    return CalibrationNeeds(peak, sums, extras, staging, cpu_ram, sum(files) + head_file, states, named)
