"""One typed view of DeepSeek-V4 (flat `deepseek_v4` config) and V4.1 (`text_config` under a wrapper).

Every later stage reads shapes and layer roles from here, never from raw config dicts, so the two
architectures differ in exactly one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from quantizer.caches import value_hash
from quantizer.errors import UserError
from quantizer.workdir import read_json

V4 = "v4"
V41 = "v41"

ARCHITECTURES = {"DeepseekV4ForCausalLM": V4, "DeepseekV41ForCausalLM": V41}
MODEL_TYPES = {"deepseek_v4": V4, "deepseek_v41": V41}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict
    max_position_embeddings: int
    n_routed_experts: int
    n_shared_experts: int
    experts_per_token: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    sliding_window: int
    compress_ratios: tuple[int, ...]  # trunk layers only
    num_mtp_blocks: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_hash_layers: int
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 0
    engram_compressed_vocab_size: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_experts_per_token: int = 0
    fp8_block: tuple[int, int] = (128, 128)
    expert_dtype: str = "fp4"
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    vision: dict | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    __hash__ = value_hash  # rope_scaling is a dict: a process cache keys on the values

    # ---- layer roles -------------------------------------------------------------------------

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_kv_source(self, layer: int) -> bool:
        """V4.1: the layer owns a compressor (and writes global KV). V4: every compressed layer."""
        if self.arch == V4:
            return self.ratio(layer) != 0
        return layer in self.kv_source_layer_ids

    def is_index_source(self, layer: int) -> bool:
        """The layer owns an indexer query (V4: every CSA layer, ratio 4)."""
        if self.arch == V4:
            return self.ratio(layer) == 4
        return layer in self.index_source_layer_ids

    def owns_index_keys(self, layer: int) -> bool:
        """V4.1: index keys are projected from the compressed latent by kv+index sources only."""
        return self.is_index_source(layer) and self.is_kv_source(layer)

    def kv_source_for(self, layer: int) -> int | None:
        """The nearest kv source at or below `layer` with the same ratio (V4.1 Reuse/Reindex)."""
        return _nearest_source(self.kv_source_layer_ids if self.arch == V41 else range(self.num_layers),
                               layer, self.compress_ratios)

    def index_source_for(self, layer: int) -> int | None:
        if self.arch == V4:
            return layer if self.ratio(layer) == 4 else None
        return _nearest_source(self.index_source_layer_ids, layer, self.compress_ratios)

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    def experts_in(self, block: str) -> int:
        """Routed experts in a trunk layer (`layers`) or a drafter block (`mtp`)."""
        if block == "mtp" and self.dspark_n_routed_experts:
            return self.dspark_n_routed_experts
        return self.n_routed_experts

    def engram_rows(self, layer: int) -> int:
        return self.engram_num_embeddings[self.engram_layer_ids.index(layer)]

    # ---- parsing -----------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_json(path, "config.json not found"), source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "ModelConfig":
        if not isinstance(data, dict):
            raise UserError(f"{source}: not a JSON object")
        arch = _architecture(data, source)
        text = data.get("text_config") if arch == V41 else data
        if not isinstance(text, dict):
            raise UserError(f"{source}: a deepseek_v41 config needs a text_config object")
        # A pack's config keeps the source's native quantization (for its passthrough FP8/FP4 tensors)
        # under original_quantization_config; quantization_config then describes EXL3.
        quant = (data.get("original_quantization_config") or data.get("quantization_config")
                 or text.get("quantization_config") or {})
        if not isinstance(quant, dict):
            raise UserError(f"{source}: quantization_config is not an object")
        get = _Values(text, source)
        top = _Values(data, source)

        layers = get.int("num_hidden_layers")
        ratios = list(get.ints("compress_ratios"))
        if len(ratios) < layers:
            raise UserError(f"{source}: compress_ratios has {len(ratios)} entries for {layers} layers")
        allowed = {0, 4, 128} if arch == V4 else {0, 1, 2}
        bad = sorted(set(ratios) - allowed)
        if bad:
            raise UserError(f"{source}: compress_ratios holds {bad}; {arch} allows only {sorted(allowed)}")
        mtp_blocks = len(ratios) - layers or get.int("num_nextn_predict_layers", 0)
        block = _Values(quant, source).ints("weight_block_size", (128, 128))
        if len(block) != 2:
            raise UserError(f"{source}: weight_block_size {list(block)} is not [rows, cols]")
        expert_dtype = quant.get("expert_dtype", text.get("expert_dtype", data.get("expert_dtype", "fp4")))
        rope_scaling = dict(get.object("rope_scaling"))
        if "type" in rope_scaling and "rope_type" not in rope_scaling:
            rope_scaling["rope_type"] = rope_scaling.pop("type")

        cfg = cls(
            arch=arch,
            vocab_size=get.int("vocab_size"),
            hidden_size=get.int("hidden_size"),
            moe_intermediate_size=get.int("moe_intermediate_size"),
            num_layers=layers,
            num_heads=get.int("num_attention_heads"),
            head_dim=get.int("head_dim"),
            rope_dim=get.int("qk_rope_head_dim"),
            q_lora_rank=get.int("q_lora_rank"),
            o_lora_rank=get.int("o_lora_rank"),
            o_groups=get.int("o_groups"),
            swiglu_limit=get.float("swiglu_limit", 10.0),
            rms_norm_eps=get.float("rms_norm_eps", 1e-6),
            rope_theta=get.float("rope_theta", 10000),
            compress_rope_theta=get.float("compress_rope_theta", 160000),
            rope_scaling=rope_scaling,
            max_position_embeddings=get.int("max_position_embeddings", 1048576),
            n_routed_experts=get.int("n_routed_experts"),
            n_shared_experts=get.int("n_shared_experts", 1),
            experts_per_token=get.int("num_experts_per_tok"),
            routed_scaling_factor=get.float("routed_scaling_factor", 1.0),
            norm_topk_prob=get.bool("norm_topk_prob", True),
            sliding_window=get.int("sliding_window"),
            compress_ratios=tuple(ratios[:layers]),
            num_mtp_blocks=mtp_blocks,
            index_n_heads=get.int("index_n_heads"),
            index_head_dim=get.int("index_head_dim"),
            index_topk=get.int("index_topk"),
            hc_mult=get.int("hc_mult", 4),
            hc_sinkhorn_iters=get.int("hc_sinkhorn_iters", 20),
            hc_eps=get.float("hc_eps", 1e-6),
            num_hash_layers=get.int("num_hash_layers", 0) if arch == V4 else 0,
            kv_source_layer_ids=get.ints("kv_source_layer_ids"),
            index_source_layer_ids=get.ints("index_source_layer_ids"),
            candidate_source_layer_id=get.int("candidate_source_layer_id", None),
            candidate_topk_blocks=get.int("candidate_topk_blocks", 0),
            candidate_block_size=get.int("candidate_block_size", 0),
            engram_layer_ids=get.ints("engram_layer_ids"),
            engram_num_embeddings=get.ints("engram_num_embeddings"),
            engram_max_ngram_size=get.int("engram_max_ngram_size", 0),
            engram_vocab_size=get.int("engram_vocab_size", 0),
            engram_n_heads=get.int("engram_n_heads", 0),
            engram_head_dim=get.int("engram_head_dim", 0),
            engram_pad_token_id=get.int("engram_pad_token_id", 0),
            engram_compressed_vocab_size=get.int("engram_compressed_vocab_size", 0),
            dspark_block_size=get.int("dspark_block_size", 0),
            dspark_noise_token_id=get.int("dspark_noise_token_id", 0),
            dspark_target_layer_ids=get.ints("dspark_target_layer_ids"),
            dspark_markov_rank=get.int("dspark_markov_rank", 0),
            dspark_n_routed_experts=get.int("dspark_n_routed_experts", 0),
            dspark_experts_per_token=get.int("dspark_num_experts_per_tok", 0),
            fp8_block=(int(block[0]), int(block[1])),
            expert_dtype=str(expert_dtype),
            tie_word_embeddings=get.bool("tie_word_embeddings", False),
            bos_token_id=top.int("bos_token_id", get.int("bos_token_id", 0)),
            eos_token_id=top.int("eos_token_id", get.int("eos_token_id", 1)),
            vision=(top.object("vision_config") or None) if arch == V41 else None,
            raw=data,
        )
        cfg._check(source)
        return cfg

    def _check(self, source: str) -> None:
        if self.hc_mult != 4:
            raise UserError(f"{source}: hc_mult is {self.hc_mult}; DeepSeek V4/V4.1 and EXL3 need 4")
        if self.num_heads % self.o_groups:
            raise UserError(f"{source}: num_attention_heads {self.num_heads} is not a multiple of o_groups {self.o_groups}")
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            raise UserError(f"{source}: engram_layer_ids and engram_num_embeddings differ in length")
        if self.arch == V41:
            for layer, r in enumerate(self.compress_ratios):
                if r and (self.kv_source_for(layer) is None or self.index_source_for(layer) is None):
                    raise UserError(
                        f"{source}: layer {layer} is compressed (ratio {r}) but has no kv and index source "
                        "at or below it with the same ratio"
                    )
            if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
                raise UserError(f"{source}: kv_source_layer_ids must be a subset of index_source_layer_ids")


def _architecture(data: dict, source: str) -> str:
    archs = data.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    mt = data.get("model_type")
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    named = ", ".join(archs) or mt or "none"
    raise UserError(
        f"{source}: unknown architecture {named}; quantizer reads DeepseekV4ForCausalLM (deepseek_v4) "
        "and DeepseekV41ForCausalLM (deepseek_v41)"
    )


class _Values:
    """Typed reads of one config object: a value of the wrong type (a string where a number belongs,
    say) is a UserError naming the key, not a traceback later."""

    REQUIRED = object()

    def __init__(self, values: dict, source: str):
        self.values, self.source = values, source

    def _get(self, key: str, default, ok, kind: str):
        if key not in self.values or (self.values[key] is None and default is None):  # null: an optional key unset
            if default is self.REQUIRED:
                raise UserError(f"{self.source}: missing required key {key!r}")
            return default
        value = self.values[key]
        if not ok(value):
            raise UserError(f"{self.source}: {key} is {value!r}; it must be {kind}")
        return value

    def int(self, key: str, default=REQUIRED) -> int:
        return self._get(key, default, lambda v: type(v) is int and v >= 0, "a whole number, 0 or more")

    def float(self, key: str, default=REQUIRED) -> float:
        return float(self._get(key, default, lambda v: type(v) in (int, float) and math.isfinite(v), "a number"))

    def bool(self, key: str, default: bool) -> bool:
        return self._get(key, default, lambda v: type(v) is bool, "true or false")

    def ints(self, key: str, default=()) -> tuple[int, ...]:
        ok = lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)  # noqa: E731
        return tuple(self._get(key, default, ok, "a list of whole numbers"))

    def object(self, key: str) -> dict:
        return self._get(key, None, lambda v: v is None or isinstance(v, dict), "an object") or {}


def _nearest_source(sources, layer: int, ratios: tuple[int, ...]) -> int | None:
    r = ratios[layer]
    if r == 0:
        return None
    found = [s for s in sources if s <= layer and ratios[s] == r]
    return max(found) if found else None
