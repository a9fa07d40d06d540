"""What flows from one block to the next besides the hc streams, for one batch of token rows.

V4 blocks need only the token ids (hash routing) and the RoPE tables. V4.1 blocks also hand state
forward: the pending pre-mix of the delayed mHC collapse, the compressed KV (and index keys) of each
kv-source layer, the top-k selections of each index-source layer (read by Reuse layers), and the
candidate blocks of the candidate source (read by Reindex layers). All of it is per token row and
small next to the streams (entries are 1/ratio of the tokens; selections are [rows, tokens, k]).
The forward is stateless across calls: every row starts at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantizer.checkpoint.config import ModelConfig
from quantizer.model.rope import RopeTables

# Elements of one query chunk's attention scores (fp32); bounds attention memory per chunk.
DEFAULT_ATTN_CHUNK_ELEMENTS = 1 << 27


@dataclass
class CompressedKV:
    """A kv source's entries (RoPE'd at their group's first position) and, for key owners, index keys."""

    entries: torch.Tensor  # [B, n, head_dim]
    index_keys: torch.Tensor | None  # [B, n, index_head_dim]
    ratio: int


@dataclass
class ForwardState:
    cfg: ModelConfig
    tokens: torch.Tensor  # [B, S] int64
    compute_dtype: torch.dtype
    rope: RopeTables
    attn_chunk_elements: int = DEFAULT_ATTN_CHUNK_ELEMENTS
    pre_mix: torch.Tensor | None = None  # V4.1: [B, S, hc_mult], the next collapse's coefficients
    compressed: dict[int, CompressedKV] = field(default_factory=dict)
    selections: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, S, k], -1 = none
    candidates: torch.Tensor | None = None  # [B, S, blocks] candidate block ids, -1 = none

    @classmethod
    def start(cls, cfg: ModelConfig, tokens: torch.Tensor, compute_dtype: torch.dtype,
              attn_chunk_elements: int = DEFAULT_ATTN_CHUNK_ELEMENTS) -> ForwardState:
        return cls(cfg, tokens, compute_dtype, RopeTables.build(cfg, tokens.shape[1], tokens.device),
                   attn_chunk_elements)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]
