"""Layer streaming: run token rows through a model too big for memory, one block at a time.

Each block's tensors are read from a weight source, dequantized onto the device, applied to every
row chunk, and dropped. Between blocks only the hc streams (rows x tokens x hc_mult x D, float32)
and the small per-row state of state.py stay resident; the embedding is loaded at the start and
norm/head (+ V4's hc_head) at the end. Engram tables are never loaded: their rows are gathered from
disk per forward. The result equals `DeepseekModel` on the same weights (tests check it).

A weight source is anything with `config`, `weight(name, dtype, device)`, `table_rows(name, dtype,
device)` and `engram_token_map()`; `CheckpointSource` wraps a native `Checkpoint`. A quality check
can wrap another source (decoded EXL3 weights for the tensors a pack quantized) or swap weights at
forward time through `ForwardHooks.weight_override`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from tqdm import tqdm

from quantizer.checkpoint.config import V41, ModelConfig
from quantizer.checkpoint.dequant import dequantize
from quantizer.checkpoint.safetensors_file import TORCH_DTYPES, TensorEntry
from quantizer.checkpoint.source import is_engram_table
from quantizer.model.block import Block
from quantizer.model.engram import RowReader, token_map_for
from quantizer.model.hooks import ForwardHooks
from quantizer.model.layout import native_layout
from quantizer.model.state import DEFAULT_ATTN_CHUNK_ELEMENTS
from quantizer.model.transformer import DeepseekModel
from quantizer.report import gib

TABLE_SUFFIX = ".engram.embed.weight"


class WeightSource(Protocol):
    config: ModelConfig

    def weight(self, name: str, dtype: torch.dtype, device) -> torch.Tensor: ...

    def table_rows(self, name: str, dtype: torch.dtype, device) -> RowReader: ...

    def engram_token_map(self) -> torch.Tensor | None: ...


class CheckpointSource:
    """A native checkpoint as a weight source; Engram rows are read from the shards on demand."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self.config = checkpoint.config

    def weight(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        return self.checkpoint.weight(name, dtype, device)

    def table_rows(self, name: str, dtype: torch.dtype, device) -> RowReader:
        weight = self.checkpoint.entry(name)
        scale = self.checkpoint.entry(self.checkpoint.scale_name(name))

        def read(ids: torch.Tensor) -> torch.Tensor:
            unique, inverse = torch.unique(ids.reshape(-1).cpu(), return_inverse=True)
            rows = dequantize(gather_rows(weight, unique), gather_rows(scale, unique), name, dtype, device)
            return rows[inverse.to(rows.device)].view(*ids.shape, -1)

        return read

    def engram_token_map(self) -> torch.Tensor | None:
        return token_map_for(self.checkpoint.root, self.config)


def gather_rows(entry: TensorEntry, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a stored 2-D tensor, read from its shard without reading the rest."""
    row_bytes = entry.nbytes // entry.shape[0]
    table = np.memmap(entry.path, dtype=np.uint8, mode="r", offset=entry.offset, shape=(entry.shape[0], row_bytes))
    data = torch.from_numpy(np.ascontiguousarray(table[rows.numpy()]))
    return data.view(TORCH_DTYPES[entry.dtype]).view(len(rows), -1)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak device memory of a streamed forward, in bytes (an estimate, rounded up)."""

    weights: int  # the largest set of tensors resident at once: one block, or embed/head
    states: int  # hc streams and carried state of all rows
    activations: int  # one row chunk through one block (or one row's logits)

    @property
    def total(self) -> int:
        return self.weights + self.states + self.activations

    def describe(self) -> str:
        return (f"peak memory estimate {gib(self.total)} GiB = weights {gib(self.weights)} (largest block) "
                f"+ states {gib(self.states)} + activations {gib(self.activations)}")


def block_weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Bytes each block (`layers.L`) and each root tensor takes once dequantized, as the model holds it."""
    size = torch.empty(0, dtype=dtype).element_size()
    out: dict[str, int] = {}
    for spec in native_layout(cfg):
        if spec.name.endswith(".scale") or is_engram_table(spec.name) or not spec.name.startswith(
                ("layers.", "embed.", "head.", "norm.", "hc_head_")):
            continue
        per = {"F32": 4, "I64": 8}.get(spec.dtype, size)
        key = ".".join(spec.name.split(".")[:2]) if spec.name.startswith("layers.") else spec.name
        out[key] = out.get(key, 0) + spec.params * per
    return out


def estimate_stream_memory(cfg: ModelConfig, rows: int, length: int, dtype: torch.dtype, row_chunk: int,
                           attn_chunk_elements: int = DEFAULT_ATTN_CHUNK_ELEMENTS) -> MemoryEstimate:
    size = torch.empty(0, dtype=dtype).element_size()
    weights = block_weight_bytes(cfg, dtype)
    root = max(weights.get("embed.weight", 0), sum(v for k, v in weights.items() if not k.startswith(("layers", "embed"))))
    block = max((v for k, v in weights.items() if k.startswith("layers.")), default=0)
    D, n, H, hd = cfg.hidden_size, cfg.hc_mult, cfg.num_heads, cfg.head_dim
    per_token_state = n * D * 4 + n * 4
    if cfg.arch == V41:
        for layer in range(cfg.num_layers):
            r = cfg.ratio(layer)
            if cfg.is_kv_source(layer):
                per_token_state += (hd + (cfg.index_head_dim if cfg.owns_index_keys(layer) else 0)) * 4 // r
            if cfg.is_index_source(layer):
                per_token_state += min(cfg.index_topk, length // r) * 8
        per_token_state += cfg.candidate_topk_blocks * 8
    tokens = row_chunk * length
    # q, roped q, attention output, de-rotated output; routed inputs, outputs and per-pair outputs;
    # three generations of streams; indexer queries; fp32 sublayer outputs
    per_token_act = (4 * H * hd * size + 3 * cfg.experts_per_token * D * size + 3 * n * D * 4
                     + cfg.index_n_heads * cfg.index_head_dim * 4 + 2 * D * 4)
    expert_hidden = tokens * cfg.moe_intermediate_size * size * 3  # worst case: one expert takes every token
    scores = row_chunk * max(H, cfg.index_n_heads) * length * (2 * length + cfg.sliding_window)
    attention_chunk = min(attn_chunk_elements, scores) * 4 * 4  # scores, probabilities, masks
    block_act = tokens * per_token_act + expert_hidden + attention_chunk
    logits_act = length * cfg.vocab_size * 4 * 3
    return MemoryEstimate(max(block, root), rows * length * per_token_state, max(block_act, logits_act))


def load_block(source: WeightSource, layer: int, dtype: torch.dtype, device) -> Block:
    """Block `layers.L` with its tensors from `source` on `device` (Engram rows stay on disk)."""
    with torch.device("meta"):
        block = Block(source.config, layer, dtype)
    wanted = {k: t for k, t in block.state_dict().items() if not is_engram_table(f"layers.{layer}.{k}")}
    tensors = {k: source.weight(f"layers.{layer}.{k}", t.dtype, device) for k, t in wanted.items()}
    block.load_state_dict(tensors, assign=True, strict=False)
    if block.engram is not None:
        block.engram.embed.reader = source.table_rows(f"layers.{layer}{TABLE_SUFFIX}", dtype, device)
    return block


class LayerStreamer:
    """Streams token rows through a weight source's model; see the module docstring.

    row_chunk: rows pushed through a block together (all by default); attn_chunk_elements bounds one
    attention chunk's scores; report receives the memory estimate line before any work starts."""

    def __init__(self, source: WeightSource, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 hooks: ForwardHooks | None = None, row_chunk: int | None = None,
                 attn_chunk_elements: int = DEFAULT_ATTN_CHUNK_ELEMENTS, progress: bool = True,
                 report: Callable[[str], None] | None = None):
        self.source, self.cfg = source, source.config
        self.device, self.dtype, self.hooks = torch.device(device), dtype, hooks
        self.row_chunk, self.attn_chunk_elements = row_chunk, attn_chunk_elements
        self.progress = progress
        self.report = report if report is not None else (lambda line: print(line, file=sys.stderr))

    def estimate(self, rows: int, length: int) -> MemoryEstimate:
        return estimate_stream_memory(self.cfg, rows, length, self.dtype, min(rows, self.row_chunk or rows),
                                      self.attn_chunk_elements)

    @torch.no_grad()
    def row_logits(self, tokens: torch.Tensor) -> Iterator[torch.Tensor]:
        """Logits [length, vocab] float32 on the device, one row at a time, in row order. All blocks
        run before the first row is yielded."""
        rows, length = tokens.shape
        self.report(self.estimate(rows, length).describe())
        chunk = min(rows, self.row_chunk or rows)
        with torch.device("meta"):
            root = DeepseekModel(self.cfg, self.dtype, self.source.engram_token_map(), with_layers=False)
        self._load(root, ("embed.weight",))
        parts = [root.start(tokens[i:i + chunk].to(self.device), self.attn_chunk_elements)
                 for i in range(0, rows, chunk)]
        root.embed.to("meta")
        for layer in tqdm(range(self.cfg.num_layers), desc="layers", unit="layer", disable=not self.progress):
            block = load_block(self.source, layer, self.dtype, self.device)
            parts = [(block(streams, state, root.hasher, self.hooks), state) for streams, state in parts]
            del block
        self._load(root, [k for k in root.state_dict() if k != "embed.weight"])
        for streams, state in parts:
            hidden = root.final_hidden(streams, state)
            for row in hidden:
                yield root.head(row.to(self.dtype), self.hooks).float()

    def _load(self, root: DeepseekModel, names) -> None:
        types = root.state_dict()
        tensors = {k: self.source.weight(k, types[k].dtype, self.device) for k in names}
        root.load_state_dict(tensors, assign=True, strict=False)
