"""V4.1 Engram: hashed n-gram memories gated into the hc streams before the layer's attention mix.

Semantics follow vLLM's V4.1 port of DeepSeek's inference/engram.py and the exllamav3 fork (they
agree; DeepSeek's own file was not available):
- Token ids map to a compressed vocabulary (tokens whose text normalises alike share an id:
  NFKC, NFD, strip accents, lowercase, whitespace runs to one space, strip; partial UTF-8 byte
  tokens keep their raw form). A checkpoint without a tokenizer (tiny random models) uses the
  identity map, which needs vocab_size <= engram_compressed_vocab_size.
- At each position the n-grams ending there (n = 2..max_ngram) are hashed: token t-s (or the
  compressed pad id before the row start) times an odd per-layer multiplier (numpy
  default_rng(10007·layer)), XOR-accumulated over s, modulo a distinct prime per (n, head); primes
  are taken upward from engram_vocab_size per n, never reused, and their sums are the table sizes.
- The (max_ngram-1)·heads rows (each head_dim wide, FP8 + E8M0 per 32 on disk) are concatenated;
  `wkv` maps them to hc_mult keys and one value (each hidden_size). Per stream j:
  g = sigmoid(signed_sqrt(<rms(h_j), q_j·k_j·rms(key_j)> / sqrt(D))), streams_j += g · value.
Image rows (which break n-grams and get gate 0 in the serving code) do not occur in this text-only
forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from quantizer.checkpoint.config import ModelConfig
from quantizer.errors import UserError
from quantizer.model.hooks import ForwardHooks
from quantizer.model.linear import NativeLinear

GATE_FLOOR = 1e-6
RowReader = Callable[[torch.Tensor], torch.Tensor]  # row ids (any shape) -> [..., head_dim] float32


def compressed_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """(compressed id per token id [vocab] int64, number of compressed ids) from a `tokenizers.Tokenizer`."""
    from tokenizers import Regex, normalizers

    lone_space = "\ue000"  # private-use stand-in so a token that is one space survives Strip()
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), lone_space),
        normalizers.Strip(), normalizers.Replace(lone_space, " "),
    ])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids: dict[str, int] = {}
    mapping = torch.empty(size, dtype=torch.long, device="cpu")
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        mapping[token_id] = ids.setdefault(key, len(ids))
    return mapping, len(ids)


def identity_token_map(cfg: ModelConfig) -> torch.Tensor:
    if cfg.vocab_size > cfg.engram_compressed_vocab_size:
        raise UserError(
            f"the model has Engram layers and {cfg.vocab_size} tokens but engram_compressed_vocab_size is "
            f"{cfg.engram_compressed_vocab_size}: its tokenizer.json is needed to build the compressed vocabulary"
        )
    return torch.arange(cfg.vocab_size, dtype=torch.long, device="cpu")


def token_map_for(root: Path, cfg: ModelConfig) -> torch.Tensor | None:
    """The compressed map from `root/tokenizer.json`, or None (identity) when there is none."""
    path = Path(root) / "tokenizer.json"
    if not cfg.engram_layer_ids or not path.exists():
        return None
    from quantizer.textdata import load_tokenizer

    mapping, size = compressed_token_map(load_tokenizer(path))
    if size != cfg.engram_compressed_vocab_size:
        raise UserError(f"{path}: normalises to {size} distinct tokens but the config's "
                        f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}; wrong tokenizer")
    return mapping


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_primes(cfg: ModelConfig) -> list[list[int]]:
    """Per Engram layer, the primes of its (n-gram order, head) columns, order-major."""
    seen: set[int] = set()
    layers = []
    for _ in cfg.engram_layer_ids:
        columns = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            current = cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                columns.append(current)
        layers.append(columns)
    return layers


class EngramHasher:
    """Row ids of each position's n-grams, per Engram layer: [B, S, (max_ngram-1)·heads]."""

    def __init__(self, cfg: ModelConfig, token_map: torch.Tensor | None = None):
        token_map = identity_token_map(cfg) if token_map is None else token_map
        primes = engram_primes(cfg)
        for layer, columns, rows in zip(cfg.engram_layer_ids, primes, cfg.engram_num_embeddings):
            if sum(columns) != rows:
                raise UserError(f"config: Engram layer {layer} table has {rows} rows but its hash primes sum to "
                                f"{sum(columns)}; engram_num_embeddings does not match the hashing scheme")
        bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
        multipliers = [np.random.default_rng(10007 * layer).integers(0, bound, size=(cfg.engram_max_ngram_size,),
                                                                      dtype=np.int64) * 2 + 1
                       for layer in cfg.engram_layer_ids]
        self.layers = tuple(cfg.engram_layer_ids)
        self.max_ngram = cfg.engram_max_ngram_size
        self.heads = cfg.engram_n_heads
        self.token_map = token_map.long()
        self.pad_id = int(token_map[cfg.engram_pad_token_id])
        # explicit CPU: models are often built under a meta-device context
        self.primes = torch.tensor(primes, dtype=torch.long, device="cpu")  # [layers, cols]
        self.offsets = torch.tensor([np.cumsum([0, *c[:-1]]).tolist() for c in primes], dtype=torch.long,
                                    device="cpu")
        self.multipliers = torch.tensor(np.stack(multipliers), dtype=torch.long, device="cpu")  # [layers, ngram]

    def hash_ids(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        i = self.layers.index(layer)
        device = tokens.device
        compressed = self.token_map.to(device)[tokens]
        mult = self.multipliers[i].to(device)
        primes = self.primes[i].to(device).view(self.max_ngram - 1, self.heads)
        offsets = self.offsets[i].to(device).view(self.max_ngram - 1, self.heads)
        rolling = compressed * mult[0]
        columns = []
        for shift in range(1, self.max_ngram):
            back = torch.nn.functional.pad(compressed, (shift, 0), value=self.pad_id)[:, : tokens.shape[1]]
            rolling = torch.bitwise_xor(rolling, back * mult[shift])
            columns.append(rolling.unsqueeze(-1) % primes[shift - 1] + offsets[shift - 1])
        return torch.cat(columns, dim=-1)


class EngramTable(nn.Module):
    """`engram.embed`: the hashed rows, held dequantized for small models; streaming instead sets
    `reader` to gather rows from disk, since real tables are ~100 GB each."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype))
        self.reader: RowReader | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.reader is not None:
            return self.reader(ids)
        return torch.nn.functional.embedding(ids, self.weight)


class Engram(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.layer = layer
        self.eps = cfg.rms_norm_eps
        self.n, D = cfg.hc_mult, cfg.hidden_size
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.embed = EngramTable(cfg.engram_rows(layer), cfg.engram_head_dim, dtype)
        self.wkv = NativeLinear(cols * cfg.engram_head_dim, D * (self.n + 1), f"{prefix}.wkv.weight", dtype)
        self.q_weight = nn.Parameter(torch.empty(self.n, D, dtype=dtype))
        self.k_weight = nn.Parameter(torch.empty(self.n, D, dtype=dtype))

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor, hooks: ForwardHooks | None) -> torch.Tensor:
        """streams [B, S, n, D] fp32, hash_ids [B, S, cols] -> streams with the gated value added."""
        B, S, n, D = streams.shape
        rows = self.embed(hash_ids).flatten(2)
        kv = self.wkv(rows, hooks).float()
        key = kv[..., : n * D].view(B, S, n, D)
        value = kv[..., n * D:]
        rstd = torch.rsqrt(streams.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        qk = self.q_weight.float() * self.k_weight.float()
        dot = (streams * qk * key).sum(-1) * rstd * D ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_FLOOR).sqrt(), dot))
        return streams + gate.unsqueeze(-1) * value.unsqueeze(-2)
