"""Perplexity from a streamed model: per-row log-probabilities, then NLL statistics.

`row_predictions` yields each row's next-token log-probabilities from any `LayerStreamer`, so a
comparison of two models (a pack against its source: KL, top-1 agreement, paired NLL deltas) can
zip two of them over the same rows; each holds only its hc streams while the other runs.

Standard error: std(per-token NLL) / sqrt(tokens), i.e. tokens treated as independent. Tokens in
one row are correlated, so this understates the uncertainty of the mean somewhat.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from quantizer.errors import UserError
from quantizer.model.streaming import LayerStreamer


class NonFiniteLogits(UserError):
    """The model computed NaN or inf: its weights are corrupt, and no perplexity can be reported."""


@dataclass(frozen=True)
class RowPredictions:
    row: int
    log_probs: torch.Tensor  # [cols-1, vocab] float32: predictions for tokens 1..cols-1
    targets: torch.Tensor  # [cols-1] the tokens they predict

    def nll(self) -> torch.Tensor:
        """Per-token negative log-likelihood, float64 on the CPU."""
        picked = self.log_probs.gather(-1, self.targets.to(self.log_probs.device)[:, None])[:, 0]
        return (-picked).double().cpu()


@dataclass(frozen=True)
class PplResult:
    ppl: float
    nll: float
    nll_stderr: float
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def row_predictions(streamer: LayerStreamer, rows: torch.Tensor, bar: bool = True) -> Iterator[RowPredictions]:
    """Each row's predictions; where the streamer shows its progress and `bar`, a bar over the rows (the
    head), opened once the streamer's bar over layers is done: on a large vocabulary a long row's head
    takes seconds."""
    done = None
    try:
        for index, (row, logits) in enumerate(zip(rows, streamer.row_logits(rows))):
            if done is None:
                done = tqdm(total=rows.shape[0], desc="rows", unit="row", disable=not (bar and streamer.progress))
            if not torch.isfinite(logits).all():
                raise NonFiniteLogits(f"row {index}: the model's logits are not finite (NaN or inf), so its weights "
                                      "are corrupt")
            yield RowPredictions(index, torch.log_softmax(logits[:-1], dim=-1), row[1:])
            done.update()
    finally:
        if done is not None:
            done.close()


def summarize(nll: torch.Tensor) -> PplResult:
    n = nll.numel()
    mean = float(nll.mean())
    stderr = float(nll.std(unbiased=True)) / math.sqrt(n) if n > 1 else float("nan")
    return PplResult(ppl=math.exp(mean), nll=mean, nll_stderr=stderr, tokens=n)


def perplexity(streamer: LayerStreamer, rows: torch.Tensor) -> PplResult:
    """Mean next-token NLL over all rows (every position but each row's first is predicted)."""
    return summarize(torch.cat([p.nll() for p in row_predictions(streamer, rows)]))
