"""Shard layout rules: cap, units kept whole, Engram tables alone, order."""

from __future__ import annotations

from pathlib import Path

from quantizer.checkpoint.safetensors_file import TensorEntry
from quantizer.exl3 import PACK_ALIGN
from quantizer.model.tensor_classes import classify
from quantizer.pack.shards import PackTensor, assign_shards


def _t(name: str, nbytes: int) -> PackTensor:
    entry = TensorEntry(name, "U8", (nbytes,), Path("src.safetensors"), 0, nbytes)
    return PackTensor(name, entry, "native", classify(name).cls)


def _layout(shards):
    return [[t.name for t in s.tensors] for s in shards]


def test_layers_fill_shards_up_to_the_cap_without_being_split():
    tensors = [_t(f"layers.{layer}.attn_norm.weight", 300) for layer in range(3)]
    tensors += [_t(f"layers.{layer}.ffn_norm.weight", 300) for layer in range(3)]
    shards = assign_shards(tensors, cap=2 * (600 + 2 * PACK_ALIGN))
    assert _layout(shards) == [
        ["layers.0.attn_norm.weight", "layers.0.ffn_norm.weight", "layers.1.attn_norm.weight", "layers.1.ffn_norm.weight"],
        ["layers.2.attn_norm.weight", "layers.2.ffn_norm.weight"],
    ]
    assert [s.file for s in shards] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_a_unit_over_the_cap_is_cut_between_tensors_and_a_huge_tensor_stands_alone():
    tensors = [_t("layers.0.a.weight", 100), _t("layers.0.b.weight", 100), _t("layers.0.c.weight", 5000),
               _t("layers.0.d.weight", 100)]
    assert _layout(assign_shards(tensors, cap=400)) == [
        ["layers.0.a.weight", "layers.0.b.weight"], ["layers.0.c.weight"], ["layers.0.d.weight"],
    ]


def test_engram_tables_get_shards_of_their_own_and_come_last():
    tensors = [
        _t("layers.1.engram.embed.weight", 10), _t("layers.1.engram.embed.scale", 10),
        _t("layers.1.engram.wkv.weight", 10), _t("layers.4.engram.embed.weight", 10),
        _t("embed.weight", 10), _t("layers.0.attn_norm.weight", 10), _t("mtp.0.attn_norm.weight", 10),
    ]
    shards = assign_shards(tensors, cap=1 << 20)
    assert _layout(shards) == [
        ["embed.weight", "layers.0.attn_norm.weight", "layers.1.engram.wkv.weight", "mtp.0.attn_norm.weight"],
        ["layers.1.engram.embed.scale", "layers.1.engram.embed.weight"],
        ["layers.4.engram.embed.weight"],
    ]
    assert [s.engram for s in shards] == [False, True, True]
