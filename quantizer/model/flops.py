"""Model FLOPs of a forward (2 per multiply-add), for benchmarks that report achieved FLOP/s.

Counted: every linear, the attention products over the keys each query actually uses (its window
plus its selected or visible compressed entries), the indexer's scoring over visible entries, the
mHC and router projections, Engram's wkv. Not counted: elementwise work, softmaxes, Sinkhorn.
Masked-out keys that a chunked dense implementation still multiplies do not count as useful work.
"""

from __future__ import annotations

from quantizer.checkpoint.config import V4, ModelConfig


def layer_flops(cfg: ModelConfig, layer: int, length: int, all_experts: bool = False) -> float:
    """FLOPs of block `layers.L` over one row of `length` tokens starting at position 0."""
    D, H, hd, q, G, o = (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                         cfg.o_lora_rank)
    IH, ihd, n, I = cfg.index_n_heads, cfg.index_head_dim, cfg.hc_mult, cfg.moe_intermediate_size
    E, k = cfg.experts_in("layers"), cfg.experts_per_token
    per_token = D * q + q * H * hd + D * hd + H * hd * o + G * o * D  # attention projections
    per_token += 2 * n * D * (2 * n + n * n)  # two mHC sites
    per_token += D * E + 3 * D * I * cfg.n_shared_experts  # router, shared expert
    per_token += (2 * E * D * I + k * D * I) if all_experts else 3 * k * D * I
    macs = per_token * length
    window = sum(min(t + 1, cfg.sliding_window) for t in range(length))
    macs += 2 * H * hd * window
    r = cfg.ratio(layer)
    if r:
        visible = [(t + 1) // r for t in range(length)]
        entries = length // r
        if cfg.arch == V4:
            width = 2 * hd if r == 4 else hd
            macs += 2 * D * width * length
            attended = sum(min(v, cfg.index_topk) for v in visible) if r == 4 else sum(visible)
            if r == 4:
                macs += 2 * D * 2 * ihd * length + (q * IH * ihd + D * IH) * length + IH * ihd * sum(visible)
        else:
            if cfg.is_kv_source(layer):
                macs += D * hd * length * (2 if r > 1 else 1)
                if cfg.owns_index_keys(layer):
                    macs += hd * ihd * entries
            if cfg.is_index_source(layer):
                macs += (q * IH * ihd + D * IH) * length + IH * ihd * sum(visible)
            attended = sum(min(v, cfg.index_topk) for v in visible)
        macs += 2 * H * hd * attended
    if layer in cfg.engram_layer_ids:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        macs += cols * cfg.engram_head_dim * (n + 1) * D * length
    return 2.0 * macs


def model_flops(cfg: ModelConfig, rows: int, cols: int) -> float:
    """FLOPs of the whole forward (every layer and the head) over `rows` rows of `cols` tokens."""
    return rows * (sum(layer_flops(cfg, layer, cols) for layer in range(cfg.num_layers))
                   + 2 * cols * cfg.hidden_size * cfg.vocab_size)
