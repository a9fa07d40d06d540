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

That is the `exllamav3` profile's form; a profile whose engine reads another fills its own template
(contract/engine_config.py).

quantization_config.json adds `tensor_storage`: for every EXL3 linear exactly what exllamav3 records
(stored tensors with shape, n_bytes and torch dtype; quant_format; bits_per_weight; the codebook
multiplier), and for native tensors the same stored-tensor listing under their parent module name.
"""

from __future__ import annotations

import copy
import math

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
