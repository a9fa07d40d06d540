"""Compressed KV and the lightning indexer, for V4 (CSA/HCA) and V4.1 (CSA2).

V4 (transformers 5.23 semantics, the ground truth here): every compressed layer owns a compressor.
  HCA (ratio 128): softmax(wgate·x + ape) over each window of 128 tokens pools wkv·x per channel.
  CSA (ratio 4): projections are 2·dim wide; entry w pools window w-1's first half (Ca) together with
  window w's second half (Cb) over 8 slots (width 8, stride 4); entry 0 has no previous window.
  Entries are RMS-normed and RoPE'd (compress table) at their window's first position w·ratio.
  CSA layers add an indexer with its own CSA compressor at index_head_dim; each query keeps the
  top `index_topk` entries by  sum_h w_h · relu(q_h · k) (w = weights_proj·x / sqrt(heads),
  scores / sqrt(index_head_dim)). HCA layers attend to every closed entry.
V4.1 (vLLM V4.1 and the exllamav3 fork agree; DeepSeek's inference code was not available):
  only kv-source layers own a compressor: ratio 2 pools token pairs through a softmax gate (no ape),
  ratio 1 projects every token (no wgate). The normed latent is RoPE'd at its group's first position;
  key owners (kv ∩ index sources) also write index keys k_norm(wk·latent), RoPE'd the same way.
  Index-source layers score those keys with their own wq_b/weights_proj and keep the top k; Reuse
  layers (compressed, not index sources) take the selection of their index source; Reindex layers
  (index sources after `candidate_source_layer_id` on the same entries) only score entries inside the
  candidate blocks that the candidate source chose: per query, the max score over each block of
  `candidate_block_size` entries, the block of the newest visible entry always kept, the top
  `candidate_topk_blocks` blocks. The candidate source itself selects without that mask.
Entry e (covering tokens e·m .. e·m+m-1) is visible to the query at t once its group is closed:
e < (t+1) // m. Only complete groups become entries; a trailing partial group is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quantizer.checkpoint.config import ModelConfig
from quantizer.model.hooks import ForwardHooks
from quantizer.model.linear import NativeLinear, RMSNorm
from quantizer.model.rope import RopeTable, apply_rope


def rope_entries(latent: torch.Tensor, table: RopeTable, ratio: int) -> torch.Tensor:
    """RoPE entries [B, n, d] at positions 0, ratio, 2·ratio, ..."""
    at = table.at(torch.arange(latent.shape[1], device=latent.device) * ratio)
    return apply_rope(latent, at.cos, at.sin)


def visible_counts(start: int, end: int, ratio: int, device) -> torch.Tensor:
    """How many entries queries start..end-1 may see: (t+1) // ratio."""
    return (torch.arange(start, end, device=device) + 1) // ratio


def visibility_mask(counts: torch.Tensor, n: int) -> torch.Tensor:
    """[C, n] True where entry e < counts[c]."""
    return torch.arange(n, device=counts.device)[None, :] < counts[:, None]


def ids_to_mask(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[..., k] ids (-1 = none) to a [..., n] boolean mask."""
    mask = torch.zeros((*ids.shape[:-1], n + 1), dtype=torch.bool, device=ids.device)
    mask.scatter_(-1, ids.masked_fill(ids < 0, n), True)
    return mask[..., :n]


def top_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k highest of [..., n] scores (-inf where excluded), equal scores taken lowest id first; -1 where fewer than k
    are above -inf. The indexer's ReLU makes exact ties (often at 0) common, and topk breaks them in an
    order that depends on n: a query's choice then changed with how many entries *later* tokens added,
    so a row's logits depended on the row's length. A stable sort makes the choice depend only on the
    scores a query can see."""
    values, ids = scores.sort(dim=-1, descending=True, stable=True)
    values, ids = values[..., :k], ids[..., :k]
    return torch.where(values > float("-inf"), ids, torch.full_like(ids, -1))


def candidate_blocks(scores: torch.Tensor, counts: torch.Tensor, block: int, keep: int) -> torch.Tensor:
    """V4.1 candidate source: ids [B, C, keep] of the blocks each query keeps (-1 = none)."""
    B, C, n = scores.shape
    nb = -(-n // block)
    best = F.pad(scores, (0, nb * block - n), value=float("-inf")).view(B, C, nb, block).amax(-1)
    newest = ((counts - 1).clamp_min(0) // block).view(1, C, 1).expand(B, C, 1)
    return top_ids(best.scatter(-1, newest, float("inf")), keep)


def candidate_mask(block_ids: torch.Tensor, block: int, n: int) -> torch.Tensor:
    nb = -(-n // block)
    return ids_to_mask(block_ids, nb).repeat_interleave(block, dim=-1)[..., :n]


class IndexerQuery(nn.Module):
    """An indexer's query side: `wq_b` (from the attention's normed q latent) and `weights_proj`."""

    def __init__(self, cfg: ModelConfig, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.heads, self.dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = NativeLinear(cfg.q_lora_rank, self.heads * self.dim, f"{prefix}.wq_b.weight", dtype)
        self.weights_proj = NativeLinear(cfg.hidden_size, self.heads, f"{prefix}.weights_proj.weight", dtype)

    def queries(self, q_latent: torch.Tensor, x: torch.Tensor, table: RopeTable,
                hooks: ForwardHooks | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [B, S, heads, dim] RoPE'd at the query positions, head weights [B, S, heads]), fp32."""
        B, S, _ = x.shape
        q = self.wq_b(q_latent, hooks).float().view(B, S, self.heads, self.dim)
        q = apply_rope(q, table.cos[:, None, :], table.sin[:, None, :])
        weights = self.weights_proj(x, hooks).float() * self.heads ** -0.5
        return q, weights

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[B, C, heads, dim] queries against [B, n, dim] keys -> [B, C, n]."""
        B, C = q.shape[:2]
        s = torch.bmm(q.reshape(B, C * self.heads, self.dim), keys.float().transpose(1, 2))
        s = F.relu(s.view(B, C, self.heads, -1)) * self.dim ** -0.5
        return (s * weights.unsqueeze(-1)).sum(dim=2)


class V4Compressor(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, dim: int, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.dim = ratio, dim
        self.overlap = ratio == 4
        width = 2 * dim if self.overlap else dim
        self.wkv = NativeLinear(cfg.hidden_size, width, f"{prefix}.wkv.weight", dtype)
        self.wgate = NativeLinear(cfg.hidden_size, width, f"{prefix}.wgate.weight", dtype)
        self.ape = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, table: RopeTable, hooks: ForwardHooks | None) -> torch.Tensor:
        B, S, _ = x.shape
        m, n = self.ratio, S // self.ratio
        kv = self.wkv(x, hooks).float()
        gate = self.wgate(x, hooks).float()
        if n == 0:
            return kv.new_zeros(B, 0, self.dim)
        kv = kv[:, : n * m].view(B, n, m, -1)
        gate = gate[:, : n * m].view(B, n, m, -1) + self.ape.float()
        if self.overlap:
            d = self.dim
            prev_kv = torch.cat((kv.new_zeros(B, 1, m, d), kv[:, :-1, :, :d]), dim=1)
            prev_gate = torch.cat((gate.new_full((B, 1, m, d), float("-inf")), gate[:, :-1, :, :d]), dim=1)
            kv = torch.cat((prev_kv, kv[..., d:]), dim=2)
            gate = torch.cat((prev_gate, gate[..., d:]), dim=2)
        pooled = (kv * gate.softmax(dim=2)).sum(dim=2)
        return rope_entries(self.norm(pooled), table, m)


class V4Indexer(IndexerQuery):
    def __init__(self, cfg: ModelConfig, prefix: str, dtype: torch.dtype):
        super().__init__(cfg, prefix, dtype)
        self.compressor = V4Compressor(cfg, 4, cfg.index_head_dim, f"{prefix}.compressor", dtype)


class V41Compressor(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.dim = ratio, cfg.head_dim
        self.wkv = NativeLinear(cfg.hidden_size, self.dim, f"{prefix}.wkv.weight", dtype)
        self.wgate = NativeLinear(cfg.hidden_size, self.dim, f"{prefix}.wgate.weight", dtype) if ratio > 1 else None
        self.norm = RMSNorm(self.dim, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, hooks: ForwardHooks | None) -> torch.Tensor:
        """The normed latent [B, n, head_dim] (not yet RoPE'd)."""
        B, S, _ = x.shape
        m, n = self.ratio, S // self.ratio
        kv = self.wkv(x, hooks).float()[:, : n * m].view(B, n, m, self.dim)
        if self.wgate is None:
            pooled = kv[:, :, 0]
        else:
            gate = self.wgate(x, hooks).float()[:, : n * m].view(B, n, m, self.dim)
            pooled = (kv * gate.softmax(dim=2)).sum(dim=2)
        return self.norm(pooled)


class V41Indexer(IndexerQuery):
    def __init__(self, cfg: ModelConfig, owns_keys: bool, prefix: str, dtype: torch.dtype):
        super().__init__(cfg, prefix, dtype)
        if owns_keys:
            self.wk = NativeLinear(cfg.head_dim, cfg.index_head_dim, f"{prefix}.wk.weight", dtype)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, dtype)

    def index_keys(self, latent: torch.Tensor, table: RopeTable, ratio: int,
                   hooks: ForwardHooks | None) -> torch.Tensor:
        return rope_entries(self.k_norm(self.wk(latent, hooks)), table, ratio)
