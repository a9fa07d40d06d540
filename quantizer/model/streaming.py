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
from quantizer.model.attention import CUDA_KEY_ALIGN, query_chunk
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
    """Peak device memory of a streamed forward, in bytes: the parts alive at its highest moment."""

    weights: int  # the tensors loaded then: one block, or embed / norm + head
    states: int  # hc streams and carried state of all rows (old and new streams while a layer runs)
    activations: int  # one row chunk's tensors inside the block at that moment (or one row's logits)
    moment: str = ""  # where it peaks, e.g. "layer 3 attention"

    @property
    def total(self) -> int:
        return self.weights + self.states + self.activations

    def describe(self) -> str:
        return (f"peak memory estimate {gib(self.total)} GiB = weights {gib(self.weights)} "
                f"+ states {gib(self.states)} + activations {gib(self.activations)} ({self.moment})")


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


def model_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every tensor `DeepseekModel.from_checkpoint` holds (Engram tables included): the
    whole model in memory, as the unit-KL probe and end-to-end tuning keep it."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(spec.params * {"F32": 4, "I32": 4, "I64": 8}.get(spec.dtype, size) for spec in native_layout(cfg)
               if not spec.name.endswith(".scale")
               and spec.name.startswith(("layers.", "embed.", "head.", "norm.", "hc_head_")))


def state_bytes(cfg: ModelConfig, rows: int, length: int) -> tuple[int, int]:
    """(hc streams, everything else the rows carry between blocks), float32 streams [rows, length,
    hc_mult, D]; V4.1 adds per kv source its compressed entries (and index keys), per index source
    its top-k selections, the candidate blocks, and the pending pre-mix (state.py)."""
    tokens = rows * length
    streams = tokens * cfg.hc_mult * cfg.hidden_size * 4
    per_token = 8 + cfg.hc_mult * 4  # token ids, pre-mix
    if cfg.arch == V41:
        for layer in range(cfg.num_layers):
            r = cfg.ratio(layer)
            if cfg.is_kv_source(layer):
                per_token += (cfg.head_dim + (cfg.index_head_dim if cfg.owns_index_keys(layer) else 0)) * 4 // r
            if cfg.is_index_source(layer):
                per_token += min(cfg.index_topk, length // r) * 8
        cand = cfg.candidate_source_layer_id
        if cand is not None and cfg.candidate_topk_blocks > 0 and cfg.is_index_source(cand):
            per_token += min(cfg.candidate_topk_blocks, -(-(length // cfg.ratio(cand)) // cfg.candidate_block_size)) * 8
    return streams, tokens * per_token


def entries_seen(cfg: ModelConfig, layer: int, length: int) -> int:
    """Compressed entries a query of `layer` may attend to (its kv source's)."""
    r = cfg.ratio(layer)
    return length // r if r else 0


def block_activations(cfg: ModelConfig, layer: int, rows: int, length: int, dtype: torch.dtype,
                      attn_chunk_elements: int = DEFAULT_ATTN_CHUNK_ELEMENTS, cuda: bool = False,
                      hooked: bool = False, all_experts: bool = False) -> dict[str, int]:
    """Bytes one chunk of `rows` rows holds inside block `layer`, beyond the block's weights and the
    rows' state, at each moment where the forward peaks (the tensors alive then, read off the code):

    engram     kv projection (fp32), the streams plus the gated value (two stream copies), gathered rows
    attention  the block input collapsed (V4.1 layer 0 uses a view) and normed, q latent, RoPE'd q and
               kv, indexer queries; in attend: the finished query chunks' outputs, and of the current
               chunk its queries, keys and masks with either scores (fp32), softmax (fp32) and
               probabilities (model dtype; the last chunk's too), or scores, probabilities, their
               product with the keys and that times the sink gate; or the indexer's scores for the
               chunk, the last chunk's scores still alive
    moe        streams after attention, FFN input (collapsed, normed), attention output; the routed
               pairs' inputs, outputs, outputs in order and per pair (two while index_copy runs),
               router scores; with all_experts the last expert's hidden for every token
    output     the FFN site's hc_expand: streams after attention, post x y, comb^T streams and their
               sum; the collapsed FFN input and the FFN output
    hooked (a calibration, calibrate/collect.py): its hooks hold the Engram output, the attention output
    and the MoE input until the chunk ends, and `output` is superseded by its site gains: the block's
    output, and the FFN site's hc_expand redone (four stream copies), FFN and attention outputs; then
    its check that the rebuilt output equals the block's (`site check`).
    """
    item = dtype.itemsize
    wide = item if item != 4 else 0  # a fp32 copy of a tensor in the model dtype (none when that is fp32)
    D, n, S = cfg.hidden_size, cfg.hc_mult, length
    N = rows * S
    stream = N * n * D * 4
    engram = layer in cfg.engram_layer_ids
    out: dict[str, int] = {}
    if engram:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        out["engram"] = N * ((n + 1) * D * 4 + cols * (cfg.engram_head_dim * item + 8)) + 2 * stream
    H, hd, E = cfg.num_heads, cfg.head_dim, cfg.experts_in("layers")
    entries = entries_seen(cfg, layer, S)
    indexer = cfg.is_index_source(layer) and entries > 0
    collapsed = 0 if (cfg.arch == V41 and layer == 0) else N * D * 4
    before = (stream if engram else 0) + collapsed + N * D * item + N * cfg.q_lora_rank * 4
    q = N * (H * hd + hd) * item + (N * cfg.index_n_heads * (cfg.index_head_dim + 1) * 4 if indexer else 0)
    chunk = query_chunk(rows, H, S, cfg.sliding_window, entries, attn_chunk_elements)
    keys = min(S, chunk + cfg.sliding_window - 1) + entries
    keys += -keys % CUDA_KEY_ALIGN if cuda else 0
    chunks = -(-S // chunk)
    elements = rows * H * chunk * keys
    done = N * H * hd * item * (chunks - 1) // chunks  # the finished query chunks' outputs
    per_chunk = rows * (chunk * H + keys) * hd * item + rows * entries * hd * wide + 3 * rows * chunk * keys
    scores = max(elements * (8 + wide + (item if chunks > 1 else 0)),  # the softmax
                 elements * (4 + item) + 2 * rows * H * chunk * hd * item)  # probabilities x keys, x sink gate
    selecting = (elements * (4 + item) if chunks > 1 else 0) + (
        3 * rows * chunk * cfg.index_n_heads * entries * 4 if indexer else 0)
    out["attention"] = before + q + done + per_chunk + max(scores, selecting)
    k, attn_out, ffn_in = cfg.experts_per_token, N * D * item, N * D * 4 + N * D * item
    kept_engram = stream if hooked and engram else 0
    out["moe"] = (stream + kept_engram + ffn_in + attn_out + 5 * N * k * D * item + N * E * 4
                  + (N * cfg.moe_intermediate_size * item if all_experts else 0))
    if hooked:  # collect.py's site gains, after the block: its hc_expand of the FFN site redone
        out["site gains"] = 5 * stream + kept_engram + N * D * 4 + 2 * N * D * item
        # then torch.allclose(rebuilt, output): ATen's isclose holds |a - b|, its temporary a - b and
        # atol + |rtol * b| (fp32) and a bool result, beside the two
        out["site check"] = int(5.25 * stream) + kept_engram + N * D * 4 + 2 * N * D * item
    else:
        out["output"] = 4 * stream + 2 * N * D * 4
    return out


def estimate_stream_memory(cfg: ModelConfig, rows: int, length: int, dtype: torch.dtype, row_chunk: int,
                           attn_chunk_elements: int = DEFAULT_ATTN_CHUNK_ELEMENTS,
                           cuda: bool = False) -> MemoryEstimate:
    """LayerStreamer.row_logits' peak: the highest of every block's moments (block_activations) and the
    logits. While a layer runs, the streams before it stay alive until the last chunk is through
    (the new list of parts is built from the old), so the streams count twice but one chunk's. The
    logits moment: a chunk's final hidden (and its norm), and per row what ppl holds (below)."""
    weights = block_weight_bytes(cfg, dtype)
    streams, other = state_bytes(cfg, rows, length)
    chunk_streams = streams * row_chunk // rows
    best = MemoryEstimate(0, 0, 0)
    for layer in range(cfg.num_layers):
        moments = block_activations(cfg, layer, row_chunk, length, dtype, attn_chunk_elements, cuda)
        name, act = max(moments.items(), key=lambda kv: kv[1])
        found = MemoryEstimate(weights.get(f"layers.{layer}", 0), 2 * streams - chunk_streams + other, act,
                               f"layer {layer} {name}")
        best = max(best, found, key=lambda e: e.total)
    root = sum(v for k, v in weights.items() if not k.startswith(("layers", "embed")))
    # per vocabulary entry of a row: its logits (fp32), ppl's finiteness check (|x| fp32, three bool
    # masks) and, after the first row, the last row's logits (still held by the consumer's zip while
    # the next is made) and log-probabilities: 4 + 7 (+ 4 + 4) bytes
    logits = MemoryEstimate(root, streams + other, row_chunk * length * cfg.hidden_size * 4 * 2
                            + length * cfg.vocab_size * (19 if rows > 1 else 11), "logits")
    return max(best, logits, key=lambda e: e.total)


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
                                      self.attn_chunk_elements, self.device.type == "cuda")

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
