"""Shared-KV MQA with a sliding window, attention sinks and (on compressed layers) sparse entries.

One KV head of head_dim serves as both key and value for all query heads. q = wq_b(q_norm(wq_a x))
(V4 then RMS-normalises each q head without a weight; V4.1 does not); kv = kv_norm(wkv x); both are
RoPE'd on their last rope_dim channels (main table on sliding layers, compress table on compressed
layers). Each query sees the last `sliding_window` tokens (itself included) plus the compressed
entries its layer selects (compression.py), with one learned sink logit per head in the softmax
denominator. The output's RoPE channels are de-rotated at the query position, then the grouped
projection maps head group g through rows g of `wo_a` and all groups through `wo_b`.

Queries are processed in chunks so that one chunk's scores stay within a fixed element budget:
memory is bounded independently of the sequence length.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from quantizer.checkpoint.config import V4, ModelConfig
from quantizer.errors import UserError
from quantizer.model.compression import (
    V4Compressor,
    V4Indexer,
    V41Compressor,
    V41Indexer,
    candidate_blocks,
    candidate_mask,
    ids_to_mask,
    rope_entries,
    top_ids,
    visibility_mask,
    visible_counts,
)
from quantizer.model.hooks import ForwardHooks
from quantizer.model.linear import NativeLinear, RMSNorm, rms_normalize
from quantizer.model.rope import apply_rope
from quantizer.model.state import CompressedKV, ForwardState

EntryMask = Callable[[int, int], torch.Tensor]  # (query start, end) -> [B or 1, C, n] bool


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, prefix: str, dtype: torch.dtype):
        super().__init__()
        D, H, hd, G = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.o_groups
        self.cfg, self.layer = cfg, layer
        self.ratio = cfg.ratio(layer)
        self.wq_a = NativeLinear(D, cfg.q_lora_rank, f"{prefix}.wq_a.weight", dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
        self.wq_b = NativeLinear(cfg.q_lora_rank, H * hd, f"{prefix}.wq_b.weight", dtype)
        self.wkv = NativeLinear(D, hd, f"{prefix}.wkv.weight", dtype)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.wo_a = NativeLinear(H * hd // G, G * cfg.o_lora_rank, f"{prefix}.wo_a.weight", dtype)
        self.wo_b = NativeLinear(G * cfg.o_lora_rank, D, f"{prefix}.wo_b.weight", dtype)
        self.attn_sink = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.compressor: nn.Module | None = None
        self.indexer: nn.Module | None = None
        if not self.ratio:
            return
        if cfg.arch == V4:
            self.compressor = V4Compressor(cfg, self.ratio, hd, f"{prefix}.compressor", dtype)
            if self.ratio == 4:
                self.indexer = V4Indexer(cfg, f"{prefix}.indexer", dtype)
            return
        self.kv_source = cfg.kv_source_for(layer)
        self.index_source = cfg.index_source_for(layer)
        if cfg.is_kv_source(layer):
            self.compressor = V41Compressor(cfg, self.ratio, f"{prefix}.compressor", dtype)
        if cfg.is_index_source(layer):
            self.indexer = V41Indexer(cfg, cfg.owns_index_keys(layer), f"{prefix}.indexer", dtype)
        cand = cfg.candidate_source_layer_id
        self.candidate_source = cand == layer and cfg.candidate_topk_blocks > 0
        self.candidate_consumer = (cand is not None and layer > cand and cfg.is_index_source(layer)
                                   and cfg.candidate_topk_blocks > 0 and cfg.ratio(cand) == self.ratio
                                   and cfg.kv_source_for(cand) == self.kv_source)

    def forward(self, x: torch.Tensor, state: ForwardState, hooks: ForwardHooks | None) -> torch.Tensor:
        cfg = self.cfg
        B, S, _ = x.shape
        H, hd = cfg.num_heads, cfg.head_dim
        table = state.rope.compress if self.ratio else state.rope.main
        cos, sin = table.cos[:, None, :], table.sin[:, None, :]
        q_latent = self.q_norm(self.wq_a(x, hooks))
        q = self.wq_b(q_latent, hooks).view(B, S, H, hd)
        if cfg.arch == V4:
            q = rms_normalize(q, cfg.rms_norm_eps).to(q.dtype)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.kv_norm(self.wkv(x, hooks)).to(q.dtype), table.cos, table.sin)
        entries, entry_mask = (None, None)
        if self.ratio:
            entries, entry_mask = (self._v4_entries if cfg.arch == V4 else self._v41_entries)(x, q_latent, state, hooks)
        out = attend(q, kv, entries, entry_mask, self.attn_sink, cfg.sliding_window, state.attn_chunk_elements)
        out = apply_rope(out, cos, -sin)
        grouped = self.wo_a.grouped(out.reshape(B, S, cfg.o_groups, -1), hooks)
        return self.wo_b(grouped.flatten(2), hooks)

    # ---- V4: per-layer CSA / HCA ---------------------------------------------------------------

    def _v4_entries(self, x, q_latent, state: ForwardState, hooks):
        table = state.rope.compress
        entries = self.compressor(x, table, hooks)
        n, m = entries.shape[1], self.ratio
        if n == 0:
            return None, None
        if m != 4:
            return entries, lambda c0, c1: visibility_mask(visible_counts(c0, c1, m, x.device), n)[None]
        keys = self.indexer.compressor(x, table, hooks)
        q, weights = self.indexer.queries(q_latent, x, table, hooks)

        def select(c0: int, c1: int) -> torch.Tensor:
            counts = visible_counts(c0, c1, m, x.device)
            scores = self.indexer.scores(q[:, c0:c1], weights[:, c0:c1], keys)
            scores = scores.masked_fill(~visibility_mask(counts, n)[None], float("-inf"))
            return ids_to_mask(top_ids(scores, self.cfg.index_topk), n)

        return entries, select

    # ---- V4.1: shared kv sources, index sources, Reuse / Reindex ---------------------------------

    def _v41_entries(self, x, q_latent, state: ForwardState, hooks):
        cfg, table, m, B, S = self.cfg, state.rope.compress, self.ratio, x.shape[0], x.shape[1]
        if self.compressor is not None:
            latent = self.compressor(x, hooks)
            keys = self.indexer.index_keys(latent, table, m, hooks) if cfg.owns_index_keys(self.layer) else None
            state.compressed[self.layer] = CompressedKV(rope_entries(latent, table, m), keys, m)
        source = state.compressed[self.kv_source]
        entries = source.entries
        n = entries.shape[1]
        if n == 0:
            return None, None
        if self.indexer is None:
            chosen = state.selections[self.index_source]
            return entries, lambda c0, c1: ids_to_mask(chosen[:, c0:c1], n)

        if source.index_keys is None:
            raise UserError(f"config: index source layer {self.layer} scores the entries of kv source "
                            f"{self.kv_source}, which owns no index keys (it is not an index source)")
        q, weights = self.indexer.queries(q_latent, x, table, hooks)
        chosen = torch.full((B, S, min(cfg.index_topk, n)), -1, dtype=torch.long, device=x.device)
        state.selections[self.layer] = chosen
        if self.candidate_source:
            state.candidates = torch.full((B, S, min(cfg.candidate_topk_blocks, -(-n // cfg.candidate_block_size))),
                                          -1, dtype=torch.long, device=x.device)

        def select(c0: int, c1: int) -> torch.Tensor:
            counts = visible_counts(c0, c1, m, x.device)
            scores = self.indexer.scores(q[:, c0:c1], weights[:, c0:c1], source.index_keys)
            scores = scores.masked_fill(~visibility_mask(counts, n)[None], float("-inf"))
            if self.candidate_source:
                state.candidates[:, c0:c1] = candidate_blocks(scores, counts, cfg.candidate_block_size,
                                                              cfg.candidate_topk_blocks)
            elif self.candidate_consumer and state.candidates is not None:
                allowed = candidate_mask(state.candidates[:, c0:c1], cfg.candidate_block_size, n)
                scores = scores.masked_fill(~allowed, float("-inf"))
            chosen[:, c0:c1] = top_ids(scores, cfg.index_topk)
            return ids_to_mask(chosen[:, c0:c1], n)

        return entries, select


def query_chunk(rows: int, heads: int, length: int, window: int, entries: int, budget: int) -> int:
    """Largest query chunk C with rows·heads·C·(C + window + entries) <= budget (at least 1), and
    at most max(256, 4·window): a chunk multiplies C + window - 1 window keys, so much longer
    chunks would waste work on keys outside every query's window."""
    per = budget / max(1, rows * heads)
    extra = window + entries
    c = int((-extra + math.sqrt(extra * extra + 4 * per)) / 2)
    return max(1, min(length, c, max(256, 4 * window)))


CUDA_KEY_ALIGN = 64  # on CUDA, keys per chunk padded to a multiple of this (see attend)


def attend(q: torch.Tensor, kv: torch.Tensor, entries: torch.Tensor | None, entry_mask: EntryMask | None,
           sinks: torch.Tensor, window: int, budget: int, align: int | None = None) -> torch.Tensor:
    """q [B, S, H, hd], kv [B, S, hd], entries [B, n, hd] -> [B, S, H, hd].

    Per query chunk, the window keys and the entries form one key set; scores are formed in q's
    dtype and softmaxed in float32. The sink logit joins the softmax denominator exactly through
    out = softmax(s) @ v * sigmoid(logsumexp(s) - sink). `entry_mask(c0, c1)` is called once per
    query chunk, in order.

    Each chunk's keys are padded with masked zero keys to a multiple of `align` (default
    CUDA_KEY_ALIGN on CUDA, 1 elsewhere): with rows of the probabilities 16-byte aligned cuBLAS keeps
    its fast bf16 kernels (on an H200 a full-size top-k layer ran 10% faster)."""
    B, S, H, hd = q.shape
    n = 0 if entries is None else entries.shape[1]
    entries = None if entries is None else entries.to(q.dtype)
    chunk = query_chunk(B, H, S, window, n, budget)
    scale = hd ** -0.5
    sink = sinks.float().view(1, H, 1, 1)
    align = align or (CUDA_KEY_ALIGN if q.is_cuda else 1)
    outs = []
    for c0 in range(0, S, chunk):
        c1 = min(S, c0 + chunk)
        C, k0 = c1 - c0, max(0, c0 - window + 1)
        qpos = torch.arange(c0, c1, device=q.device)[:, None]
        kpos = torch.arange(k0, c1, device=q.device)[None, :]
        keys = kv[:, k0:c1]
        allowed = ((kpos <= qpos) & (kpos > qpos - window)).expand(B, C, -1)
        if n:
            keys = torch.cat((keys, entries), dim=1)
            allowed = torch.cat((allowed, entry_mask(c0, c1).expand(B, C, n)), dim=-1)
        pad = -keys.shape[1] % align
        if pad:
            keys = torch.cat((keys, keys.new_zeros(B, pad, hd)), dim=1)
            allowed = torch.cat((allowed, allowed.new_zeros(B, C, pad)), dim=-1)
        qc = q[:, c0:c1].permute(0, 2, 1, 3).reshape(B, H * C, hd)
        # the scale rides in the GEMM epilogue (alpha), before any rounding to q's dtype
        scores = torch.baddbmm(qc.new_empty(1, 1, 1), qc, keys.transpose(1, 2), beta=0, alpha=scale)
        scores = scores.view(B, H, C, -1).float()
        scores.masked_fill_(~allowed.unsqueeze(1), float("-inf"))
        keep = torch.sigmoid(torch.logsumexp(scores, dim=-1, keepdim=True) - sink)
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(B, H * C, -1)
        o = torch.bmm(probs, keys).view(B, H, C, hd) * keep.to(q.dtype)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)
