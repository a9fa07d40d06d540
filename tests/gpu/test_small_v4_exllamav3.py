"""The bundled small V4 models run in stock exllamav3 1.6.5 as they run in our forward, on held-out text.

Both V4-architecture models: `small_model_v4` (8 experts, top-2, three DSpark blocks) and
`small_model_v4_moe64` (64 experts, top-6, no drafter; the testbed where experts are routed as sparsely
as in the real model).

Run on the GPU machine: `source .device-cache/setup.sh && python -m pytest tests/gpu/test_small_v4_exllamav3.py -q -s`.
exllamav3 loads the native FP8/FP4 checkpoint itself (Config.from_directory, Model.from_config,
model.load(); it dequantizes on load) and computes logits in fp16 with its own kernels; our forward
(the one training and `ppl` use) computes them in float32 from the same checkpoint. On trained weights
and real text the two must pick the same next token almost everywhere and give the same NLL. The
second test runs exllamav3's own converter on the model (its V4 drafter reads the Markov head as
`markov_w1.weight` / `markov_w2.weight`, and it needs the directory's tokenizer.json) and loads the
result, drafter included where the model has one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from quantizer.checkpoint.source import Checkpoint
from quantizer.model.transformer import DeepseekModel
from quantizer.ppl.exllamav3_engine import exllamav3_logits
from quantizer.shipped import shipped
from quantizer.textdata import model_rows, shipped_text_path

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and exllamav3")

ROWS, COLS = 8, 512
MIN_COSINE, MIN_TOP1, MAX_NLL_GAP = 0.999, 0.98, 0.01  # logits cosine, argmax agreement, |NLL difference| nats


@pytest.fixture(scope="module", params=["small_model_v4", "small_model_v4_moe64"])
def small_v4(request):
    return shipped(request.param)


@pytest.fixture(scope="module")
def heldout(small_v4):
    ck = Checkpoint.open(small_v4)
    return model_rows(ck.root, ck.config, text=shipped_text_path("heldout"), rows=ROWS, cols=COLS, default_cols=COLS)


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


def test_exllamav3_and_our_forward_agree_on_heldout_text(small_v4, heldout):
    theirs = exllamav3_logits(small_v4, heldout)
    model = DeepseekModel.from_checkpoint(Checkpoint.open(small_v4), torch.float32, "cuda").eval()
    with torch.no_grad():
        ours = torch.cat([model(row[None].cuda()).float().cpu() for row in heldout])
    cosine = float(torch.nn.functional.cosine_similarity(theirs.flatten().double(), ours.flatten().double(), dim=0))
    top1 = float((theirs.argmax(-1) == ours.argmax(-1)).float().mean())
    nll_theirs, nll_ours = _nll(theirs, heldout), _nll(ours, heldout)
    print(f"{small_v4.name} on {heldout.numel():,} held-out tokens: logits cosine {cosine:.6f}, top-1 agreement {top1:.4f}, "
          f"NLL exllamav3 {nll_theirs:.4f} vs ours {nll_ours:.4f}")
    assert torch.isfinite(theirs).all()
    assert cosine > MIN_COSINE and top1 > MIN_TOP1 and abs(nll_theirs - nll_ours) < MAX_NLL_GAP


def test_exllamav3_converter_runs_on_the_small_v4_models(small_v4, tmp_path):
    out = tmp_path / "exl3"
    subprocess.run([sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(small_v4), "-o", str(out),
                    "-w", str(tmp_path / "work"), "-b", "4", "-cr", "16", "-cc", "512"], check=True)
    from exllamav3 import Config, Model

    config = Config.from_directory(str(out))
    has_drafter = Checkpoint.open(small_v4).config.num_mtp_blocks > 0
    assert ("mtp" in config.model_classes) == has_drafter  # small_model_v4's three DSpark blocks were converted
    model = Model.from_config(config)
    model.load()
    logits = model.forward(torch.arange(3, 67)[None].cuda(), {"attn_mode": "flash_attn_nc"})
    model.unload()
    assert torch.isfinite(logits).all()
