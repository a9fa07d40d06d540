"""exllamav3 1.6.5's own allocator, `create_q_strategy`, as a baseline plan; runs on the CPU.

exllamav3 compiles its CUDA extension when imported. Where CUDA is absent we register a stand-in
`exllamav3.ext` module first, whose `exllamav3_ext` raises on any use (docs/exl3-format.md,
allocator): the allocator only builds the module tree and walks it. Its modules also import triton
(for kernels the allocator never runs); where triton is not installed either (the demo extra leaves
out its gigabyte), a permissive stand-in serves those imports while exllamav3 loads and is removed
again, so nothing else in the process sees a triton. Where CUDA is present exllamav3 is imported as it
is, so a later GPU stage in the same process gets the real extension.

exllamav3 1.6.5 knows V4 (`DeepseekV4ForCausalLM`) but not V4.1, so the model it plans is a V4
twin of ours: same hidden, expert, layer and attention dims; a V4.1 compressed layer becomes CSA
(ratio 4) where it owns an indexer query and HCA (128) elsewhere, so exllamav3's indexer targets
fall on our index-source layers; no hash layers (V4.1 has none). The directory it reads holds a
config.json and a header-only safetensors file.

Its rates map back to our targets one to one, except:
- `attn.wo_a.slice.G` (exllamav3 plans the fused wo_a as o_groups equal slices, each its own
  group): our single wo_a takes their mean, rounded down to an integer rate;
- compressors: one to one where our model has them (V4 always; V4.1 in its KV-source layers); the
  twin's compressors our V4.1 model lacks (reuse layers, and every `attn.indexer.compressor.*`) are
  left out;
- V4.1's `attn.indexer.wk`: the rate exllamav3 gives the twin's indexer compressor `wkv` of that
  layer (the twin's index keys), else the layer's attention `wkv`;
- Engram's `wkv` (V4.1 only): the rate exllamav3 gives the same layer's attention `wkv`.
The head takes head_bits; the DSpark drafter stays native unless drafter_bits is given (no MTP
component is built).

exllamav3 spends `bits` on its own targets and `-hq` then raises attention and shared experts
above it, so the `bits` it is given is searched (bisection) for the largest whose plan, in our
accounting, stays within the asked bpw: the baseline at equal bytes.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import struct
import sys
import tempfile
import types
from collections import defaultdict
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from quantizer.caches import process_cache
from quantizer.checkpoint.config import V4, ModelConfig
from quantizer.contract.loader_profiles import LoaderProfile, stock_profile
from quantizer.contract.plan import Plan
from quantizer.contract.rules import achieved_bpw, make_plan
from quantizer.errors import UserError
from quantizer.exl3 import drafter_k, rate_floor, rate_grid
from quantizer.model.targets import DRAFT, ENGRAM, HEAD_GROUP, target_map, targets

EXLLAMAV3_VERSION = "1.6.5"
HQ = 1  # exllamav3's -hq 1, what DSV4 conversions use (docs/exl3-format.md, allocator)
MATCH_TOLERANCE = 1e-3  # bits of exllamav3's input searched to this precision
MTP_BITS = 4  # exllamav3's default; unused (no MTP component is built)


def exl3_strategy(cfg: ModelConfig, bits: float, codebook: str = "mul1", head_bits: float = 6.0,
                  hq: int = HQ) -> tuple[dict[str, float], float]:
    """exllamav3's (per-key rates, final bits) for the V4 twin of `cfg` at `bits`, exactly as
    `create_q_strategy` returns them."""
    config, model, create_q_strategy = _model(cfg)
    return create_q_strategy(model, None, config, bits, head_bits, MTP_BITS, hq, half_steps=codebook == "mul1")


def exl3_plan(cfg: ModelConfig, bpw: float, codebook: str = "mul1", head_bits: float | None = 6.0,
              hq: int = HQ, drafter_bits: float | None = None, profile: LoaderProfile | None = None) -> Plan:
    """exllamav3's allocation at the largest `bits` whose plan stays within `bpw` (our accounting), for stock
    exllamav3 unless `profile` says otherwise."""
    profile = profile or stock_profile()
    def rates_at(bits: float) -> tuple[dict[str, float | None], float]:
        strategy, _ = exl3_strategy(cfg, bits, codebook, 6.0 if head_bits is None else head_bits, hq)
        k = our_rates(cfg, strategy, head_bits, drafter_bits)
        return k, achieved_bpw(cfg, Plan(cfg.arch, codebook, profile, k))

    lo, hi = float(rate_grid(codebook)[0]), float(rate_grid(codebook)[-1])
    best, achieved = rates_at(lo)
    if achieved > bpw + 1e-9:
        raise UserError(f"--bpw {bpw:g} is too low for exllamav3's allocator: with -hq {hq} its floors alone "
                        f"come to {achieved:.3f} bpw")
    top, achieved = rates_at(hi)
    if achieved <= bpw + 1e-9:
        lo, best = hi, top
    while hi - lo > MATCH_TOLERANCE:
        mid = (lo + hi) / 2
        k, achieved = rates_at(mid)
        if achieved <= bpw + 1e-9:
            lo, best = mid, k
        else:
            hi = mid
    made_by = (f"exllamav3.create_q_strategy(bits={lo:.4f}, hq={hq}, half_steps={codebook == 'mul1'}) "
               f"matched to {bpw:g} bpw; exllamav3 {EXLLAMAV3_VERSION} on a V4 twin")
    return make_plan(cfg, best, codebook, profile, target_bpw=bpw, made_by=made_by)


def our_rates(cfg: ModelConfig, strategy: dict[str, float], head_bits: float | None,
              drafter_bits: float | None) -> dict[str, float | None]:
    """exllamav3's per-key rates as a K for every target of ours (the mapping in the module docstring)."""
    tmap = target_map(cfg)
    k: dict[str, float | None] = {}
    slices: dict[str, list[float]] = defaultdict(list)
    twin_only: dict[str, float] = {}
    for key, rate in strategy.items():
        if key in tmap:
            k[key] = float(rate)
        elif ".wo_a.slice." in key:
            slices[key.split(".slice.")[0]].append(float(rate))
        elif ".compressor." in key:
            twin_only[key] = float(rate)
        else:
            raise ValueError(f"exllamav3 plans {key}, which this model has no target for")
    integer = rate_grid("mcg")
    for key, rates in slices.items():
        k[key] = rate_floor(sum(rates) / len(rates), integer)
    for t in targets(cfg):
        if t.group == ENGRAM:
            k[t.key] = k[f"layers.{t.layer}.attn.wkv"]
        elif t.key not in k and t.key.endswith(".attn.indexer.wk"):
            k[t.key] = twin_only.get(f"layers.{t.layer}.attn.indexer.compressor.wkv", k[f"layers.{t.layer}.attn.wkv"])
        elif t.group == HEAD_GROUP:
            k[t.key] = head_bits
        elif t.group == DRAFT:
            k[t.key] = drafter_k(drafter_bits, t.integer_only)
    missing = [key for key, t in tmap.items() if t.budgeted and key not in k]
    if missing:
        raise ValueError(f"exllamav3 gave no rate for {len(missing)} budgeted target(s), e.g. {missing[0]}")
    return k


def v4_twin_config(cfg: ModelConfig) -> dict:
    """A DeepseekV4ForCausalLM config.json with our model's shapes (module docstring)."""
    if cfg.arch == V4:
        ratios, hash_layers = list(cfg.compress_ratios), cfg.num_hash_layers
    else:
        ratios = [0 if r == 0 else 4 if cfg.is_index_source(layer) else 128 for layer, r in enumerate(cfg.compress_ratios)]
        hash_layers = 0
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": 1, "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.experts_per_token, "n_shared_experts": cfg.n_shared_experts,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
        "compress_ratios": ratios, "num_hash_layers": hash_layers, "sliding_window": cfg.sliding_window,
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
    }


@process_cache(maxsize=1)
def _model(cfg: ModelConfig) -> tuple:
    """(exllamav3 Config, Model, create_q_strategy) for the V4 twin, built once per shape."""
    with _exllamav3() as exl3, tempfile.TemporaryDirectory(prefix="exl3-twin-") as tmp:
        root = Path(tmp)
        (root / "config.json").write_text(json.dumps(v4_twin_config(cfg)))
        header = b"{}"
        (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
        config = exl3.Config.from_directory(str(root))  # imports the architectures, and with them triton
        model = exl3.Model.from_config(config)
    return config, model, exl3.create_q_strategy


@contextlib.contextmanager
def _exllamav3() -> Iterator[types.SimpleNamespace]:
    """exllamav3's Config, Model and create_q_strategy; without CUDA its extension stubbed, and triton
    too where it is absent (until the context ends)."""
    missing = missing_for_baseline()
    if missing:
        raise UserError(f"the exl3 baseline needs {' and '.join(missing)}: "
                        f"pip install exllamav3=={EXLLAMAV3_VERSION}" + (" triton" if "triton" in missing else ""))
    version = metadata.version("exllamav3")
    if version != EXLLAMAV3_VERSION:
        raise UserError(f"the exl3 baseline is written against exllamav3 {EXLLAMAV3_VERSION}, found {version}: "
                        f"pip install exllamav3=={EXLLAMAV3_VERSION}")
    cpu = not _cuda()
    if "exllamav3" not in sys.modules and cpu:
        sys.modules.setdefault("exllamav3.ext", _extension_stub())
    with _TritonStandIn() if cpu and importlib.util.find_spec("triton") is None else contextlib.nullcontext():
        from exllamav3 import Config, Model
        from exllamav3.conversion.allocation import create_q_strategy
        yield types.SimpleNamespace(Config=Config, Model=Model, create_q_strategy=create_q_strategy)


def missing_for_baseline() -> list[str]:
    """The packages the exl3 baseline lacks here: exllamav3, and triton only where CUDA runs it."""
    wanted = ("exllamav3", "triton") if _cuda() else ("exllamav3",)
    return [name for name in wanted if importlib.util.find_spec(name) is None]


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


class _MissingExtension(types.ModuleType):
    def __getattr__(self, name: str):
        def unavailable(*args, **kwargs):
            raise RuntimeError(f"exllamav3_ext.{name} needs exllamav3's CUDA extension; this process "
                               "imported exllamav3 without it (planning only)")
        return unavailable


class _Permissive:
    """Whatever exllamav3's kernel modules do with triton at import (decorators, `tl.constexpr`
    annotations, `triton.Config(...)`): a decorator returns the function, anything else another of these."""
    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and not kwargs and callable(args[0]) else _Permissive()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Permissive()

    def __getitem__(self, key):
        return _Permissive()


class _PermissiveModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Permissive()


class _TritonStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `triton` and every `triton.*` import while entered; on exit the finder and the modules it
    made leave the process (exllamav3 keeps its references to them)."""
    def __enter__(self) -> "_TritonStandIn":
        sys.meta_path.insert(0, self)
        return self

    def __exit__(self, *exc) -> None:
        sys.meta_path.remove(self)
        for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            del sys.modules[name]

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec) -> types.ModuleType:
        return _PermissiveModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def _extension_stub() -> types.ModuleType:
    stub = types.ModuleType("exllamav3.ext")
    stub.exllamav3_ext = _MissingExtension("exllamav3_ext")
    return stub
