"""Every tensor a native checkpoint of a given config holds: name, shape, storage dtype.

This is the tensor inventory of docs/deepseek-v4-layout.md as code. It
reproduces the real V4.1-Flash inventory (96,085 tensors, 510,286,023,000 payload bytes) and
V4-Flash-0731's (72,317 tensors), and it is what `make-tiny` writes, what `inspect` checks a
checkpoint against, and what `fit` sizes when there is no checkpoint at hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantizer.checkpoint.config import V4, V41, ModelConfig
from quantizer.checkpoint.safetensors_file import tensor_nbytes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)

    @property
    def params(self) -> int:
        """Logical parameters: FP4 bytes hold two, E8M0 scales hold none."""
        if self.dtype == "F8_E8M0":
            return 0
        n = 1
        for d in self.shape:
            n *= d
        return 2 * n if self.dtype == "I8" else n


class _Builder:
    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.specs: list[TensorSpec] = []

    def add(self, name: str, shape, dtype: str) -> None:
        self.specs.append(TensorSpec(name, tuple(int(d) for d in shape), dtype))

    def fp8(self, name: str, out: int, inp: int) -> None:
        """An FP8 e4m3 linear with its E8M0 block grid (`X.weight` + `X.scale`)."""
        bo, bi = self.cfg.fp8_block
        self.add(f"{name}.weight", (out, inp), "F8_E4M3")
        self.add(f"{name}.scale", (-(-out // bo), -(-inp // bi)), "F8_E8M0")

    def fp4(self, name: str, out: int, inp: int) -> None:
        """An MXFP4 linear: two e2m1 codes per byte, one E8M0 per 32 inputs."""
        self.add(f"{name}.weight", (out, inp // 2), "I8")
        self.add(f"{name}.scale", (out, inp // 32), "F8_E8M0")


def native_layout(cfg: ModelConfig) -> list[TensorSpec]:
    b = _Builder(cfg)
    D, V = cfg.hidden_size, cfg.vocab_size
    b.add("embed.weight", (V, D), "BF16")
    for layer in range(cfg.num_layers):
        _block(b, f"layers.{layer}", layer, cfg.n_routed_experts, trunk=True)
    b.add("norm.weight", (D,), "BF16")
    b.add("head.weight", (V, D), "BF16")
    if cfg.arch == V4:
        n = cfg.hc_mult
        b.add("hc_head_fn", (n, n * D), "F32")
        b.add("hc_head_base", (n,), "F32")
        b.add("hc_head_scale", (1,), "F32")
    _drafter(b)
    if cfg.vision:
        _vision(b, cfg.vision)
    return b.specs


def _block(b: _Builder, p: str, layer: int, experts: int, trunk: bool) -> None:
    """One transformer block: attention, mHC, router, routed + shared experts (+ role extras)."""
    cfg = b.cfg
    D, H, hd, I = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.moe_intermediate_size
    G, n = cfg.o_groups, cfg.hc_mult
    b.fp8(f"{p}.attn.wq_a", cfg.q_lora_rank, D)
    b.add(f"{p}.attn.q_norm.weight", (cfg.q_lora_rank,), "BF16")
    b.fp8(f"{p}.attn.wq_b", H * hd, cfg.q_lora_rank)
    b.fp8(f"{p}.attn.wkv", hd, D)
    b.add(f"{p}.attn.kv_norm.weight", (hd,), "BF16")
    b.fp8(f"{p}.attn.wo_a", G * cfg.o_lora_rank, H * hd // G)
    b.fp8(f"{p}.attn.wo_b", D, G * cfg.o_lora_rank)
    b.add(f"{p}.attn.attn_sink", (H,), "F32")
    if trunk:
        _compression(b, p, layer)
    b.add(f"{p}.attn_norm.weight", (D,), "BF16")
    b.add(f"{p}.ffn_norm.weight", (D,), "BF16")
    for site in ("attn", "ffn"):
        b.add(f"{p}.hc_{site}_fn", ((2 + n) * n, n * D), "F32")
        b.add(f"{p}.hc_{site}_base", ((2 + n) * n,), "F32")
        b.add(f"{p}.hc_{site}_scale", (3,), "F32")
    b.add(f"{p}.ffn.gate.weight", (experts, D), "BF16")
    if trunk and cfg.is_hash_layer(layer):
        b.add(f"{p}.ffn.gate.tid2eid", (cfg.vocab_size, cfg.experts_per_token), "I64")
    else:
        b.add(f"{p}.ffn.gate.bias", (experts,), "F32")
        if cfg.arch == V41:
            b.add(f"{p}.ffn.gate.bias_vl", (experts,), "F32")
    for e in range(experts):
        b.fp4(f"{p}.ffn.experts.{e}.w1", I, D)
        b.fp4(f"{p}.ffn.experts.{e}.w2", D, I)
        b.fp4(f"{p}.ffn.experts.{e}.w3", I, D)
    Is = I * cfg.n_shared_experts
    b.fp8(f"{p}.ffn.shared_experts.w1", Is, D)
    b.fp8(f"{p}.ffn.shared_experts.w2", D, Is)
    b.fp8(f"{p}.ffn.shared_experts.w3", Is, D)
    if trunk and layer in cfg.engram_layer_ids:
        _engram(b, p, layer)


def _compression(b: _Builder, p: str, layer: int) -> None:
    cfg = b.cfg
    r = cfg.ratio(layer)
    if r == 0:
        return
    D, hd, ihd = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    if cfg.arch == V4:
        # CSA (ratio 4) pools overlapping windows, so its projections are twice as wide.
        width = 2 * hd if r == 4 else hd
        _v4_compressor(b, f"{p}.attn.compressor", r, width, hd)
        if r == 4:
            b.fp8(f"{p}.attn.indexer.wq_b", cfg.index_n_heads * ihd, cfg.q_lora_rank)
            b.add(f"{p}.attn.indexer.weights_proj.weight", (cfg.index_n_heads, D), "BF16")
            _v4_compressor(b, f"{p}.attn.indexer.compressor", r, 2 * ihd, ihd)
        return
    if cfg.is_kv_source(layer):
        b.add(f"{p}.attn.compressor.wkv.weight", (hd, D), "BF16")
        b.add(f"{p}.attn.compressor.norm.weight", (hd,), "BF16")
        if r == 2:
            b.add(f"{p}.attn.compressor.wgate.weight", (hd, D), "BF16")
    if cfg.is_index_source(layer):
        b.fp8(f"{p}.attn.indexer.wq_b", cfg.index_n_heads * ihd, cfg.q_lora_rank)
        b.add(f"{p}.attn.indexer.weights_proj.weight", (cfg.index_n_heads, D), "BF16")
    if cfg.owns_index_keys(layer):
        b.add(f"{p}.attn.indexer.wk.weight", (ihd, hd), "BF16")
        b.add(f"{p}.attn.indexer.k_norm.weight", (ihd,), "BF16")


def _v4_compressor(b: _Builder, p: str, ratio: int, width: int, dim: int) -> None:
    D = b.cfg.hidden_size
    b.add(f"{p}.wkv.weight", (width, D), "BF16")
    b.add(f"{p}.wgate.weight", (width, D), "BF16")
    b.add(f"{p}.ape", (ratio, width), "F32")
    b.add(f"{p}.norm.weight", (dim,), "BF16")


def _engram(b: _Builder, p: str, layer: int) -> None:
    cfg = b.cfg
    rows, ehd = cfg.engram_rows(layer), cfg.engram_head_dim
    b.add(f"{p}.engram.embed.weight", (rows, ehd), "F8_E4M3")
    b.add(f"{p}.engram.embed.scale", (rows, ehd // 32), "F8_E8M0")
    width = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * ehd
    b.fp8(f"{p}.engram.wkv", cfg.hidden_size * (cfg.hc_mult + 1), width)
    b.add(f"{p}.engram.q_weight", (cfg.hc_mult, cfg.hidden_size), "BF16")
    b.add(f"{p}.engram.k_weight", (cfg.hc_mult, cfg.hidden_size), "BF16")


def _drafter(b: _Builder) -> None:
    """DSpark blocks `mtp.0..N-1`: sliding-window blocks fed by taps of the target layers."""
    cfg = b.cfg
    blocks = cfg.num_mtp_blocks
    if not blocks:
        return
    D, V, rank = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    experts = cfg.experts_in("mtp")
    taps = max(1, len(cfg.dspark_target_layer_ids))
    for i in range(blocks):
        p = f"mtp.{i}"
        _block(b, p, -1, experts, trunk=False)
        if i == 0:
            b.fp8(f"{p}.main_proj", D, taps * D)
            b.add(f"{p}.main_norm.weight", (D,), "BF16")
        if i == blocks - 1:
            b.add(f"{p}.norm.weight", (D,), "BF16")
            if cfg.arch == V41:
                b.add(f"{p}.markov_head.embed.weight", (V, rank), "BF16")
                b.add(f"{p}.markov_head.head.weight", (V, rank), "BF16")
            else:
                # exllamav3's MTP reads these as an Embedding and a Linear, so `.weight` leaves
                b.add(f"{p}.markov_head.markov_w1.weight", (V, rank), "BF16")
                b.add(f"{p}.markov_head.markov_w2.weight", (V, rank), "BF16")
                n = cfg.hc_mult
                b.add(f"{p}.hc_head_fn", (n, n * D), "F32")
                b.add(f"{p}.hc_head_base", (n,), "F32")
                b.add(f"{p}.hc_head_scale", (1,), "F32")
            b.add(f"{p}.confidence_head.proj.weight", (1, D + rank), "BF16")


def _vision(b: _Builder, vision: dict) -> None:
    """The ViT and aligner, all BF16.

    DeepSeek has not published V4.1's vision tensor names; these follow exllamav3's V4-Vision reader
    and are sized so the totals match the real checkpoint (266 tensors, 485,268,480 parameters).
    They only matter as passthrough bytes.
    """
    D = b.cfg.hidden_size
    h = int(vision.get("hidden_size", 1024))
    inter = int(vision.get("intermediate_size", 4 * h))
    patch = int(vision.get("patch_size", 14))
    merge = int(vision.get("downsample_ratio", 1)) ** 2
    b.add("vision.patch_embed.proj.weight", (h, 3, patch, patch), "BF16")
    b.add("vision.pos_embed", (29, h), "BF16")
    for i in range(int(vision.get("num_hidden_layers", 1))):
        p = f"vision.blocks.{i}"
        b.add(f"{p}.norm1.weight", (h,), "BF16")
        b.add(f"{p}.attn.wqkv.weight", (3 * h, h), "BF16")
        b.add(f"{p}.attn.wqkv.bias", (3 * h,), "BF16")
        b.add(f"{p}.attn.wo.weight", (h, h), "BF16")
        b.add(f"{p}.norm2.weight", (h,), "BF16")
        b.add(f"{p}.mlp.w1.weight", (inter, h), "BF16")
        b.add(f"{p}.mlp.w2.weight", (h, inter), "BF16")
        b.add(f"{p}.mlp.w3.weight", (inter, h), "BF16")
    b.add("vision.norm.weight", (h,), "BF16")
    b.add("aligner.norm.weight", (h * merge,), "BF16")
    b.add("aligner.fc1.weight", (D, h * merge), "BF16")
    b.add("aligner.fc2.weight", (D, D), "BF16")
    for token in ("image_start", "image_end", "image_newline", "image_pad"):
        b.add(f"{token}.weight", (D,), "BF16")
