"""Our V4 forward against transformers 5.23's DeepseekV4ForCausalLM on the tiny V4 checkpoint.

Tolerance: max |logit difference| <= 1e-4 (logits are O(5) here) and cosine >= 0.999999, both in
float32 on CPU. The sequences are long enough for CSA top-k (75+ entries, top 4) and HCA pooling
(2 windows of 128) to act.
"""

from __future__ import annotations

import pytest
import torch

from quantizer.checkpoint.source import Checkpoint
from quantizer.model.layout import native_layout
from quantizer.model.streaming import CheckpointSource, LayerStreamer
from quantizer.model.transformer import DeepseekModel

transformers = pytest.importorskip("transformers")

LENGTH = 320
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tiny_v4):
    return Checkpoint.open(tiny_v4)


@pytest.fixture(scope="module")
def tokens(checkpoint):
    cfg = checkpoint.config
    assert LENGTH // 128 >= 2 and LENGTH // 4 > cfg.index_topk and LENGTH > cfg.sliding_window
    return torch.randint(0, cfg.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def reference(tiny_v4, tokens):
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tiny_v4, attn_implementation="eager",
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True, scale_fmt="ue8m0", expert_dtype="fp4"),
    ).float().eval()
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "topk", _topk_ties_lowest_id_first)
        return model(tokens).logits


def _topk_ties_lowest_id_first(self, k, dim=-1, largest=True, sorted=True):
    """Tensor.topk with equal values taken lowest index first, the rule our forward uses
    (model/compression.top_ids). torch.topk leaves the order of ties unspecified, and the indexer's
    ReLU scores tie often here (exact zeros); with the same rule on both sides the comparison checks
    the arithmetic, not two arbitrary tie-breaks."""
    values, ids = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), ids.narrow(dim, 0, k)))


def _agreement(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (ours - ref).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(ours.flatten().double(), ref.flatten().double(), dim=0).item()
    return diff, cos


def test_whole_model_matches_transformers(checkpoint, tokens, reference):
    model = DeepseekModel.from_checkpoint(checkpoint)
    with torch.no_grad():
        ours = model(tokens)
    diff, cos = _agreement(ours, reference)
    assert diff <= TOLERANCE and cos >= 0.999999, (diff, cos)


def test_streaming_matches_transformers(checkpoint, tokens, reference):
    streamer = LayerStreamer(CheckpointSource(checkpoint), row_chunk=1, progress=False, report=lambda line: None)
    ours = torch.stack(list(streamer.row_logits(tokens)))
    diff, cos = _agreement(ours, reference)
    assert diff <= TOLERANCE and cos >= 0.999999, (diff, cos)


def test_state_dict_holds_every_native_tensor(checkpoint):
    model = DeepseekModel.from_checkpoint(checkpoint)
    state = model.state_dict()
    expected = {s.name for s in native_layout(checkpoint.config)
                if not s.name.endswith(".scale") and not s.name.startswith("mtp.")}
    assert set(state) == expected
    for name in expected:
        assert torch.equal(state[name], checkpoint.weight(name, state[name].dtype)), name
