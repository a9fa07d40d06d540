"""What a pack costs in quality: the pack and its source over the same rows, token by token.

KL(source || pack) of the next-token distributions (its mean and 95th percentile over the tokens), top-1
agreement, both perplexities and their ratio, and the paired NLL delta (pack - source) with its standard
error: pairing removes the variance the two models share, which is most of it, so small deltas are
measurable on a few thousand tokens. Standard errors treat tokens as independent (see perplexity.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from quantizer.ppl.perplexity import PplResult, RowPredictions, summarize


@dataclass(frozen=True)
class Comparison:
    source: PplResult
    pack: PplResult
    kl: float  # mean KL(source || pack) per predicted token, nats
    kl_stderr: float
    kl_p95: float  # 95th percentile of the per-token KL, nats: every token's value kept, numpy's linear interpolation
    top1: float  # fraction of tokens where both models' most likely next token agree
    top1_stderr: float
    nll_delta: float  # mean NLL(pack) - NLL(source), nats
    nll_delta_stderr: float
    tokens: int

    @property
    def ppl_ratio(self) -> float:
        """ppl(pack) / ppl(source) over the same tokens (= exp(nll_delta))."""
        return self.pack.ppl / self.source.ppl

    def as_dict(self) -> dict:
        return {"ppl": self.pack.ppl, "ppl_source": self.source.ppl, "ppl_ratio": self.ppl_ratio, "nll": self.pack.nll,
                "nll_source": self.source.nll, "kl": self.kl, "kl_stderr": self.kl_stderr, "kl_p95": self.kl_p95,
                "top1": self.top1,
                "top1_stderr": self.top1_stderr,
                "nll_delta": self.nll_delta, "nll_delta_stderr": self.nll_delta_stderr, "tokens": self.tokens,
                "source": asdict(self.source), "pack": asdict(self.pack)}


def _mean_stderr(x: torch.Tensor) -> tuple[float, float]:
    n = x.numel()
    return float(x.mean()), (float(x.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan"))


def compare(source: Iterable[RowPredictions], pack: Iterable[RowPredictions]) -> Comparison:
    """Compare row by row: `source` may be a list computed once and reused against several packs."""
    nll_s, nll_p, kl, agree = [], [], [], []
    for ref, test in zip(source, pack, strict=True):
        nll_s.append(ref.nll())
        nll_p.append(test.nll())
        p = test.log_probs.to(ref.log_probs.device)
        kl.append((ref.log_probs.exp() * (ref.log_probs - p)).sum(-1).double().cpu())
        agree.append((ref.log_probs.argmax(-1) == p.argmax(-1)).cpu())
    nll_s, nll_p, kl, agree = torch.cat(nll_s), torch.cat(nll_p), torch.cat(kl), torch.cat(agree)
    kl_mean, kl_err = _mean_stderr(kl)
    top1, top1_err = _mean_stderr(agree.double())
    delta, delta_err = _mean_stderr(nll_p - nll_s)
    kl_p95 = float(np.percentile(kl.numpy(), 95))
    return Comparison(summarize(nll_s), summarize(nll_p), kl_mean, kl_err, kl_p95, top1, top1_err,
                      delta, delta_err, nll_s.numel())
