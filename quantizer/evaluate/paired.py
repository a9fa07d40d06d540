"""Pack against source on one task: per metric, both scores and the paired difference.

Both models answer the same documents, so the difference is taken document by document (pack -
source) and its standard error is std(differences) / sqrt(documents): the variance the two share (hard
documents are hard for both) cancels, as in the paired NLL delta of `ppl --against`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantizer.errors import UserError


@dataclass(frozen=True)
class PairedScore:
    task: str
    metric: str
    documents: int
    source: float
    pack: float
    delta: float  # mean over documents of pack - source
    delta_stderr: float


def paired_scores(task: str, source: dict[int, dict[str, float]], pack: dict[int, dict[str, float]]) -> list[PairedScore]:
    """`source` and `pack`: document id -> {metric: value} for the same documents of `task`."""
    if source.keys() != pack.keys():
        raise UserError(f"task {task}: the two models answered different documents; rerun with the same --limit")
    docs = sorted(source)
    metrics = sorted(set.intersection(*(set(source[d]) & set(pack[d]) for d in docs))) if docs else []
    scores = []
    for metric in metrics:
        s = [float(source[d][metric]) for d in docs]
        p = [float(pack[d][metric]) for d in docs]
        diff = [b - a for a, b in zip(s, p)]
        scores.append(PairedScore(task, metric, len(docs), _mean(s), _mean(p), _mean(diff), _stderr(diff)))
    return scores


def _mean(x: list[float]) -> float:
    return sum(x) / len(x)


def _stderr(x: list[float]) -> float:
    n = len(x)
    if n < 2:
        return float("nan")
    m = _mean(x)
    return math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1) / n)
