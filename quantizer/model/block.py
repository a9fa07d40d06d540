"""One transformer block `layers.L`: (Engram), attention and MoE sublayers wired through mHC.

V4 (transformers): each site collapses the streams with its own `pre`.
V4.1 (vLLM V4.1 and the exllamav3 fork; "delayed pre-mix"): each site still computes (pre, post,
comb) from the streams it receives, but collapses its input with the `pre` of the previous site:
the attention input with the previous block's FFN-site pre (copy 0 of the streams, i.e. the
embedding, in the first block), the FFN input with this block's attention-site pre. The last FFN
pre is left in the state for the final collapse. Engram (V4.1 layers in engram_layer_ids) adds to
the streams before this block's attention-site mix, so the mix sees the injected streams.
"""

from __future__ import annotations

import torch
from torch import nn

from quantizer.checkpoint.config import V41, ModelConfig
from quantizer.model.attention import Attention
from quantizer.model.engram import Engram, EngramHasher
from quantizer.model.hooks import ForwardHooks
from quantizer.model.linear import RMSNorm
from quantizer.model.mhc import hc_collapse, hc_expand, hc_mix
from quantizer.model.moe import MoE
from quantizer.model.state import ForwardState


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        prefix = f"layers.{layer}"
        D, n = cfg.hidden_size, cfg.hc_mult
        self.cfg, self.layer = cfg, layer
        self.engram = Engram(cfg, layer, f"{prefix}.engram", dtype) if layer in cfg.engram_layer_ids else None
        self.attn = Attention(cfg, layer, f"{prefix}.attn", dtype)
        self.ffn = MoE(cfg, layer, f"{prefix}.ffn", dtype)
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        mixes = (2 + n) * n
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty(mixes, n * D, dtype=torch.float32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.empty(mixes, dtype=torch.float32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))

    def forward(self, streams: torch.Tensor, state: ForwardState, hasher: EngramHasher | None = None,
                hooks: ForwardHooks | None = None) -> torch.Tensor:
        """streams [B, S, hc_mult, D] float32 -> the same after this block."""
        cfg, dtype = self.cfg, state.compute_dtype
        if self.engram is not None:
            streams = self.engram(streams, hasher.hash_ids(state.tokens, self.layer), hooks)
        mix = hc_mix(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, cfg)
        if cfg.arch == V41:
            x = streams[:, :, 0] if state.pre_mix is None else hc_collapse(streams, state.pre_mix)
        else:
            x = hc_collapse(streams, mix.pre)
        y = self.attn(self.attn_norm(x).to(dtype), state, hooks)
        streams = hc_expand(streams, y, mix)

        ffn_mix = hc_mix(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, cfg)
        x = hc_collapse(streams, mix.pre if cfg.arch == V41 else ffn_mix.pre)
        y = self.ffn(self.ffn_norm(x).to(dtype), state.tokens, hooks)
        if cfg.arch == V41:
            state.pre_mix = ffn_mix.pre
        return hc_expand(streams, y, ffn_mix)
