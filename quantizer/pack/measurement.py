"""What a pack was measured to lose against its source, kept in its manifest (`measurement`).

`quantizer ppl PACK --against SRC --record` writes it (pack/card.py: record_measurement); the model
card reads it, so the quality a card states is always a recorded measurement, never a typed figure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LogitsEngine:
    """What computed the logits: the engine, its version, and where and in which dtype it ran."""

    name: str
    version: str
    device: str
    dtype: str


@dataclass(frozen=True)
class Measurement:
    text: str  # file name of the text (or token) file the rows were cut from
    text_sha256: str
    rows: int
    cols: int
    tokens: int  # predicted tokens (rows x (cols - 1))
    kl: float  # mean KL(source || pack) per token, nats
    kl_stderr: float
    top1: float  # fraction of tokens whose most likely next token agrees
    top1_stderr: float
    ppl: float  # the pack's perplexity
    ppl_source: float
    nll_delta: float  # mean NLL(pack) - NLL(source), nats
    nll_delta_stderr: float
    engine: LogitsEngine
    kl_p95: float | None = None  # 95th percentile of the per-token KL, nats; None: recorded before it was

    @property
    def ppl_ratio(self) -> float:
        """ppl(pack) / ppl(source) over the same tokens, from the two perplexities every record holds."""
        return self.ppl / self.ppl_source

    def to_dict(self) -> dict:
        """The record as the manifest writes it; a record made before kl_p95 existed keeps its exact keys, so the
        digest it was signed with still holds (pack/manifest.py)."""
        data = asdict(self)
        if self.kl_p95 is None:
            del data["kl_p95"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Measurement":
        return cls(**{**data, "engine": LogitsEngine(**data["engine"])})

