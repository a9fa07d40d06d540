"""Measured unit sensitivity: the KL a layer's unit causes at the output when only it is quantized.

For every trunk layer and unit (attention with the indexer query, Engram's wkv, the shared expert,
the routed experts together: summary.KL_UNITS) the unit's budgeted tensors get Gaussian noise at the
allocator's K 3 proxy level and the mean per-token KL(native || perturbed) over a few calibration
rows is recorded. Tensor t gets W + s G with G iid N(0, 1) (fixed per key), s chosen so that

    tr(E H E^T) / tr(W H W^T) = KL_RELATIVE_ERROR x ldlq_factor_t      (E = s G, H its mean input Hessian)

which is the relative output error the allocator's model assumes for t at K 3 (plan/sensitivity.py:
exllamav3's mul1 distortion at K 3 times the LDLQ factor). sensitivity.py then puts each unit's
modelled cost on this measured scale: what the stream-energy site gains only approximate (on the
bundled small model they fall with depth ~8x faster than the KL each site causes).

It needs the dequantized model in memory (`KLProbe`): the rows' input to every layer is cached once,
so a unit of layer L reruns layers L.. only. `unit_kl_needs` states the memory; the calibrate stage
measures by default only where it fits (the real V4.1-Flash does not: there the summary keeps the
stream-energy gains and says so).
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping

import torch
from tqdm import tqdm

from quantizer.calibrate.analysis import out_energy
from quantizer.calibrate.summary import REFERENCE_RATE, TensorStats, kl_unit
from quantizer.checkpoint.config import ModelConfig
from quantizer.exl3 import model_proxy
from quantizer.model.hooks import ForwardHooks
from quantizer.model.state import DEFAULT_ATTN_CHUNK_ELEMENTS, ForwardState
from quantizer.model.streaming import estimate_stream_memory, model_bytes
from quantizer.model.targets import targets
from quantizer.model.transformer import DeepseekModel

MEMORY_SHARE = 0.5  # measure only when the probe needs at most this share of the free memory
WEIGHT_SUFFIX = ".weight"


def kl_relative_error() -> float:
    """The relative output error of the probe's noise per unit of LDLQ factor: the allocator's K 3
    proxy (mul1), so that a unit's measured KL is its cost at the model's reference rate."""
    return float(model_proxy([REFERENCE_RATE], "mul1")[0])


def unit_keys(cfg: ModelConfig) -> dict[tuple[int, str], list[str]]:
    """(layer, unit) -> the budgeted target keys it perturbs, in layout order."""
    units: dict[tuple[int, str], list[str]] = defaultdict(list)
    for t in targets(cfg):
        if t.budgeted:
            units[t.layer, kl_unit(t.group)].append(t.key)
    return dict(units)


def probe_rows(tokens: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`rows` evenly spaced calibration rows (all when fewer), their first `cols` tokens."""
    take = min(rows, tokens.shape[0])
    index = torch.linspace(0, tokens.shape[0] - 1, take).round().long()
    return tokens[index, :cols]


# ---- memory ---------------------------------------------------------------------------------------

def unit_kl_needs(cfg: ModelConfig, rows: int, cols: int, dtype: torch.dtype) -> int:
    """Bytes the probe holds: every tensor the model keeps in memory (Engram tables included), the
    rows' streams at every layer's input, the native log-probabilities, one forward's activations."""
    weights = model_bytes(cfg, dtype)
    tokens = rows * cols
    streams = (cfg.num_layers + 1) * tokens * cfg.hc_mult * cfg.hidden_size * 4
    log_probs = tokens * cfg.vocab_size * 4
    forward = estimate_stream_memory(cfg, rows, cols, dtype, rows)
    return weights + streams + log_probs + forward.states + forward.activations


def free_memory(device: str) -> int:
    """Bytes free for the probe: the GPU's free memory (this process's cached blocks returned first: they
    are its own to reuse), or the host's MemAvailable."""
    if device == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fits(needs: int, free: int) -> bool:
    return needs <= MEMORY_SHARE * free


# ---- the probe ------------------------------------------------------------------------------------

class KLProbe:
    """The native model in memory and its forward on fixed rows, cached at every layer's input, so
    that KL(native || perturbed) of any weight replacement reruns only the layers it touches."""

    @torch.no_grad()
    def __init__(self, model: DeepseekModel, tokens: torch.Tensor,
                 attn_chunk_elements: int = DEFAULT_ATTN_CHUNK_ELEMENTS):
        self.model = model
        streams, state = model.start(tokens, attn_chunk_elements)
        self.inputs: list[tuple[torch.Tensor, ForwardState]] = []
        for block in model.layers:
            self.inputs.append((streams, _copy_state(state)))
            streams = block(streams, state, model.hasher)
        self.native = [torch.log_softmax(row, -1) for row in self._row_logits(streams, state)]

    @torch.no_grad()
    def kl(self, replaced: Mapping[str, torch.Tensor]) -> float:
        """Mean per-token KL(native || model with `replaced` native weight names -> weights), nats."""
        layers = [int(name.split(".")[1]) for name in replaced if name.startswith("layers.")]
        first = min(layers, default=0)
        if not layers:
            raise ValueError("KLProbe.kl: no trunk weight to replace")
        streams, state = self.inputs[first]
        state = _copy_state(state)
        hooks = ForwardHooks(weight_override=lambda name, _w: replaced.get(name))
        for block in self.model.layers[first:]:
            streams = block(streams, state, self.model.hasher, hooks)
        total, count = 0.0, 0
        for native, logits in zip(self.native, self._row_logits(streams, state)):
            perturbed = torch.log_softmax(logits, -1)
            total += float((native.exp() * (native - perturbed)).sum())
            count += native.shape[0]
        return total / count

    def _row_logits(self, streams: torch.Tensor, state: ForwardState):
        hidden = self.model.final_hidden(streams, state)
        for row in hidden:
            yield self.model.head(row.to(self.model.dtype)).float()


def _copy_state(state: ForwardState) -> ForwardState:
    """A state a rerun may extend without touching the cached one (blocks assign or add entries;
    they do not write into tensors an earlier layer made)."""
    return dataclasses.replace(state, compressed=dict(state.compressed), selections=dict(state.selections))


def hessian_noise(key: str, weight: torch.Tensor, h: torch.Tensor, relative_error: float,
                  seed: int = 0) -> torch.Tensor:
    """W + s G with G iid N(0, 1) fixed by (key, seed), tr(E H E^T) = relative_error x tr(W H W^T)."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()) ^ seed)
    g = torch.randn(weight.shape, generator=gen)
    w, h = weight.float().cpu(), h.float().cpu()
    scale = relative_error * out_energy(w, h) / max(out_energy(g, h), 1e-30)
    return (w + g * scale ** 0.5).to(weight)


def measure_unit_kl(model: DeepseekModel, tokens: torch.Tensor, stats: Mapping[str, TensorStats],
                    mean_hessian: Callable[[str], torch.Tensor | None], progress: bool = True
                    ) -> dict[int, dict[str, float]]:
    """layer -> unit -> KL(native || that unit at the K 3 proxy) on `tokens` (module docstring).
    `mean_hessian(key)` is a target's mean input H, None where no token reached it (no noise)."""
    level = kl_relative_error()
    probe = KLProbe(model, tokens)
    weights = dict(model.named_parameters())
    units = unit_keys(model.cfg)
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for (layer, unit), keys in tqdm(sorted(units.items()), desc="unit KL", unit="unit", disable=not progress):
        replaced = {}
        for key in keys:
            h = mean_hessian(key)
            if h is not None:
                name = key + WEIGHT_SUFFIX
                replaced[name] = hessian_noise(key, weights[name].data, h, level * stats[key].ldlq_factor)
        out[layer][unit] = probe.kl(replaced) if replaced else 0.0
    return dict(out)
