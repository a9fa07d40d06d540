"""What a quantize job is run with, beyond its source and plan; job.json pins all of it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from quantizer import __version__
from quantizer.errors import UserError

DEVICES = ("cpu", "cuda")
ENCODERS = ("fast", "exact")


@dataclass(frozen=True)
class QuantizeSettings:
    seed: int = 0
    device: str = "cpu"  # cpu: our codec; cuda: exllamav3
    encoder: str = "fast"  # CPU encoder: fast or exact Viterbi first pass
    calibration: dict | None = None  # {"fingerprint", "rows", "cols"} of the Hessians; None: uncalibrated

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise UserError(f"--device {self.device!r}; choose {' or '.join(DEVICES)}")
        if self.encoder not in ENCODERS:
            raise UserError(f"--encoder {self.encoder!r}; choose {' or '.join(ENCODERS)}")

    def record(self) -> dict:
        """What job.json pins: a resume with any other value is refused."""
        rec = asdict(self)
        if self.device == "cuda":
            rec["encoder"] = "exllamav3"  # the CPU encoder mode does not apply
        return {**rec, "quantizer_version": __version__}
