"""The pack's config.json and quantization_config.json, in the form exllamav3 1.6.5 writes them.

`quantization_config` (config.json) follows exllamav3's compile step: quant_method "exl3", version,
head_bits, codebook, calibration, with the source's own block kept as `original_quantization_config`
(native FP8/FP4 tensors remain in the pack). Two fields differ, as GB10 loaders and the Hub want:
`bits` is an integer and the exact rate is `bpw`.

- `bpw`: exllamav3's `bits` figure (`final_bits`): K weighted by weights over the budgeted targets
  (experts, attention, indexer query, Engram wkv; one kept native counts at its source precision),
  the head (`head_bits`), drafter and vision outside it; the plan's `achieved_bpw`, to 2 decimals;
- `bits`: `bpw` rounded half up to an integer (2.5 -> 3, 2.49 -> 2); K per tensor lives in
  quantization_config.json, so nothing should read `bits` as a K;
- `version`: the exllamav3 format version the pack is written for (what the field means in packs
  exllamav3 writes); the producing tool is `quantizer_version`.

That is the `exllamav3` profile's form. A profile whose engine reads another form carries it as a
template in its JSON (configs/loaders/, docs/loader-profiles.md): string values starting with `$`
are filled from the pack (`profile_values`): `$bits`, `$bpw`, `$codebook`, `$head_bits`,
`$drafter_bits`, `$default_routed_k` (the most common routed K, within the profile's config_bits_range:
what the engine parses as `bits`), `$uniform_layer_bits` ({layer: K} of every layer whose routed experts
all hold one K in that range: vllm-exl3 sizes a uniform layer from `layer_bits`),
`$source_block` (the source's FP8 block), `$num_layers` (where the DSpark blocks start in vLLM's
numbering) and `$source:KEY=DEFAULT` (the source's own quantization_config KEY). The config is
written exactly so, and verify refills the template from what the shards hold and compares.

quantization_config.json adds `tensor_storage`: for every EXL3 linear exactly what exllamav3 records
(stored tensors with shape, n_bytes and torch dtype; quant_format; bits_per_weight; the codebook
multiplier), and for native tensors the same stored-tensor listing under their parent module name.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

from quantizer import __version__
from quantizer.checkpoint.safetensors_file import TORCH_DTYPES
from quantizer.exl3 import Codebook, k_from_trellis, trellis_k
from quantizer.pack.shards import PackTensor

EXLLAMAV3_TARGET = "1.6.5"


def exl3_key(name: str) -> str:
    """The module a tensor belongs to: `<key>` of `<key>.trellis`, the parent of a native tensor."""
    return name.rsplit(".", 1)[0] if "." in name else name


def integer_bits(bpw: float) -> int:
    return math.floor(bpw + 0.5)


def quantization_config(
    source_config: dict,
    bpw: float,
    head_bits: float | int,
    codebook: Codebook,
    calibration: dict | None,
) -> dict:
    qcfg = {
        "quant_method": "exl3",
        "version": EXLLAMAV3_TARGET,
        "bits": integer_bits(bpw),
        "bpw": round(bpw, 2),
        "head_bits": head_bits,
        "codebook": codebook.value,
        "calibration": calibration,
        "quantizer_version": __version__,
    }
    if source_config.get("quantization_config"):
        qcfg["original_quantization_config"] = copy.deepcopy(source_config["quantization_config"])
    return qcfg


EXLLAMAV3_FORM = "exllamav3"


def profile_values(bits: int, bpw: float, codebook: str, head_k: float | None, drafter_k: list[float],
                   routed_k: list[tuple[int, float]], source_config: dict, fp8_block, num_layers: int,
                   bits_range: tuple[int, int]) -> dict:
    """What a template's placeholders stand for, from the K the pack holds ((layer, K) of every routed
    expert linear) and the source."""
    lo, hi = bits_range
    common = Counter(k for _, k in routed_k).most_common(1)
    by_layer: dict[int, set[float]] = {}
    for layer, k in routed_k:
        by_layer.setdefault(layer, set()).add(k)
    return {
        "bits": bits, "bpw": round(bpw, 2), "codebook": codebook,
        "head_bits": None if head_k is None else _number(head_k),
        "drafter_bits": _number(Counter(drafter_k).most_common(1)[0][0]) if drafter_k else None,
        "default_routed_k": min(hi, max(lo, int(common[0][0]))) if common else lo,
        "uniform_layer_bits": {str(layer): int(next(iter(ks))) for layer, ks in sorted(by_layer.items())
                               if len(ks) == 1 and lo <= next(iter(ks)) <= hi},
        "source_block": [int(fp8_block[0]), int(fp8_block[1])], "num_layers": num_layers,
        "source": dict(source_config.get("quantization_config") or {}),
    }


def fill_template(template, values: dict):
    """The template with every `$placeholder` string replaced by its value (recursively)."""
    if isinstance(template, dict):
        return {k: fill_template(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [fill_template(v, values) for v in template]
    if not (isinstance(template, str) and template.startswith("$")):
        return template
    name = template[1:]
    if name.startswith("source:"):
        key, _, default = name[len("source:"):].partition("=")
        return values["source"].get(key, default)
    if name not in values:
        raise ValueError(f"loader template placeholder {template} is not one of {sorted(values)}")
    return values[name]


def _number(k: float) -> int | float:
    return int(k) if float(k).is_integer() else float(k)


def pack_config(source_config: dict, qcfg: dict) -> dict:
    """The source config with EXL3's quantization_config and untied embeddings (the head is stored)."""
    out = copy.deepcopy(source_config)
    out["quantization_config"] = qcfg
    out["tie_word_embeddings"] = False
    if isinstance(out.get("text_config"), dict) and "tie_word_embeddings" in out["text_config"]:
        out["text_config"]["tie_word_embeddings"] = False
    return out


def tensor_storage(tensors: list[PackTensor], codebook: Codebook) -> dict:
    storage: dict[str, dict] = {}
    for t in sorted(tensors, key=lambda t: t.name):
        module = storage.setdefault(exl3_key(t.name), {"stored_tensors": {}})
        module["stored_tensors"][t.name] = {
            "shape": list(t.source.shape),
            "n_bytes": t.nbytes,
            "dtype": str(TORCH_DTYPES[t.source.dtype]),
        }
        if t.name.endswith(".trellis"):
            module["quant_format"] = "exl3"
            module["bits_per_weight"] = trellis_k(k_from_trellis(t.source.shape), codebook)
            if codebook.marker is not None:
                module[f"{codebook.value}_multiplier"] = codebook.marker
    return storage
