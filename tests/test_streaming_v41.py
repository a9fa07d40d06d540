"""Layer streaming on V4.1: identical logits to the whole model (Engram rows read from disk), and a
memory estimate that adds up for the real V4.1-Flash shapes."""

from __future__ import annotations

import torch

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.source import Checkpoint
from quantizer.model.hooks import ForwardHooks
from quantizer.model.streaming import CheckpointSource, LayerStreamer, block_weight_bytes, estimate_stream_memory
from quantizer.model.transformer import DeepseekModel
from quantizer.shipped import model_config_path


def test_streaming_equals_the_whole_model(tiny_v41):
    ck = Checkpoint.open(tiny_v41)
    tokens = torch.randint(3, ck.config.vocab_size, (3, 90), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = DeepseekModel.from_checkpoint(ck)(tokens)
    seen: list[str] = []
    lines: list[str] = []
    streamer = LayerStreamer(CheckpointSource(ck), row_chunk=2, progress=False, report=lines.append,
                             hooks=ForwardHooks(linear_input=lambda name, x: seen.append(name)))
    streamed = torch.stack(list(streamer.row_logits(tokens)))
    torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-5)
    assert lines and lines[0].startswith("peak memory estimate")
    assert "layers.1.engram.wkv.weight" in seen and "head.weight" in seen


def test_memory_estimate_for_v41_flash_layer():
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    blocks = block_weight_bytes(cfg, torch.bfloat16)
    experts = 384 * 3 * 2304 * 5120 * 2
    assert experts < blocks["layers.3"] < experts * 1.05
    assert blocks["embed.weight"] == 129280 * 5120 * 2
    estimate = estimate_stream_memory(cfg, rows=16, length=2048, dtype=torch.bfloat16, row_chunk=16)
    streams = 16 * 2048 * 4 * 5120 * 4
    assert streams < estimate.states < 2 * streams
    assert estimate.weights == max(blocks.values())
    assert estimate.total < 80 * 2**30
