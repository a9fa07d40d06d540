"""The whole model for small checkpoints (tests, training), with native parameter names.

`DeepseekModel(cfg).state_dict()` holds exactly the native tensor names of `native_layout(cfg)`
minus the `.scale` grids (weights are held dequantized), the DSpark drafter (`mtp.*`) and vision
(`vision.*`, `aligner.*`, `image_*`): those stay checkpoint weights without a forward here.
F32 native tensors (hc_*, attn_sink, ape, gate.bias) are always held in float32; everything else in
the model dtype (float32 on CPU; bfloat16 is fine on GPU). The residual streams, norms, mHC,
routing and softmaxes are computed in float32.

Big checkpoints go through streaming.py, which runs the same blocks one at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from quantizer.checkpoint.config import V4, V41, ModelConfig
from quantizer.model.block import Block
from quantizer.model.engram import EngramHasher, token_map_for
from quantizer.model.hooks import ForwardHooks
from quantizer.model.linear import NativeLinear, RMSNorm
from quantizer.model.mhc import hc_collapse, hc_head_collapse
from quantizer.model.state import DEFAULT_ATTN_CHUNK_ELEMENTS, ForwardState


class Embedding(nn.Module):
    """`embed.weight` [vocab, D], looked up by token id."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim, dtype=dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(tokens, self.weight)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, token_map: torch.Tensor | None = None,
                 with_layers: bool = True):
        """with_layers=False builds the root tensors only (embed, norm, head, hc_head): streaming
        loads the blocks itself."""
        super().__init__()
        D, n = cfg.hidden_size, cfg.hc_mult
        self.cfg, self.dtype = cfg, dtype
        self.embed = Embedding(cfg.vocab_size, D, dtype)
        self.layers = nn.ModuleList(Block(cfg, layer, dtype) for layer in range(cfg.num_layers if with_layers else 0))
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.head = NativeLinear(D, cfg.vocab_size, "head.weight", dtype)
        if cfg.arch == V4:
            self.hc_head_fn = nn.Parameter(torch.empty(n, n * D, dtype=torch.float32))
            self.hc_head_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
            self.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        self.hasher = EngramHasher(cfg, token_map) if cfg.engram_layer_ids else None

    @classmethod
    def from_checkpoint(cls, ck, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        token_map: torch.Tensor | None = None) -> DeepseekModel:
        """Every tensor the model holds, dequantized from a `Checkpoint` (small models: all in memory).
        The Engram token map comes from the checkpoint's tokenizer.json when there is one."""
        if token_map is None:
            token_map = token_map_for(ck.root, ck.config)
        with torch.device("meta"):
            model = cls(ck.config, dtype, token_map)
        tensors = {name: ck.weight(name, t.dtype, device) for name, t in model.state_dict().items()}
        model.load_state_dict(tensors, assign=True)
        return model

    def start(self, tokens: torch.Tensor, attn_chunk_elements: int = DEFAULT_ATTN_CHUNK_ELEMENTS):
        """Token rows [B, S] -> (hc streams [B, S, hc_mult, D] float32, the forward state)."""
        state = ForwardState.start(self.cfg, tokens, self.dtype, attn_chunk_elements)
        x = self.embed(tokens).float()
        return x.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous(), state

    def final_hidden(self, streams: torch.Tensor, state: ForwardState) -> torch.Tensor:
        """Collapse the streams (V4: hc_head; V4.1: the last FFN site's pre-mix) and apply the final norm."""
        if self.cfg.arch == V41:
            x = streams[:, :, 0] if state.pre_mix is None else hc_collapse(streams, state.pre_mix)
        else:
            x = hc_head_collapse(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg)
        return self.norm(x)

    def logits(self, streams: torch.Tensor, state: ForwardState, hooks: ForwardHooks | None = None) -> torch.Tensor:
        return self.head(self.final_hidden(streams, state).to(self.dtype), hooks).float()

    def forward(self, tokens: torch.Tensor, hooks: ForwardHooks | None = None,
                attn_chunk_elements: int = DEFAULT_ATTN_CHUNK_ELEMENTS) -> torch.Tensor:
        """Token rows [B, S] (each starting at position 0) -> logits [B, S, vocab] float32."""
        streams, state = self.start(tokens, attn_chunk_elements)
        for block in self.layers:
            streams = block(streams, state, self.hasher, hooks)
        return self.logits(streams, state, hooks)


def init_parameters(module: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for training from scratch (a DeepseekModel or a single Block), drawn on each
    tensor's own device: linears and tables N(0, std), norms and Engram q/k weights 1, mHC
    projections N(0, std/10) with unit scales and zero biases, sinks/ape/selection biases 0,
    hash tables random distinct experts."""
    generators: dict[torch.device, torch.Generator] = {}

    def normal(t: torch.Tensor, s: float) -> torch.Tensor:
        gen = generators.setdefault(t.device, torch.Generator(device=t.device).manual_seed(seed))
        return (torch.randn(t.shape, generator=gen, device=t.device) * s).to(t.dtype)

    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("norm.weight", "q_weight", "k_weight", "_scale")):
                p.fill_(1.0)
            elif name.endswith(("_base", "attn_sink", "ape")):
                p.zero_()
            elif name.endswith("_fn"):
                p.copy_(normal(p, std * 0.1))
            else:
                p.copy_(normal(p, std))
        for name, b in module.named_buffers():
            if name.endswith("tid2eid"):
                scores = normal(torch.empty(b.shape[0], module.cfg.n_routed_experts, device=b.device), 1.0)
                b.copy_(scores.argsort(dim=1)[:, : b.shape[1]])
            else:
                b.zero_()
