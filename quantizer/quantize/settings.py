"""What a quantize job is run with, beyond its source and plan; job.json pins all of it."""

from __future__ import annotations

from dataclasses import dataclass

from quantizer import __version__
from quantizer.calibrate.storage import HessianRecord
from quantizer.errors import UserError

DEVICES = ("cpu", "cuda")
# Per device, its encoders, the default first. cpu: our codec's Viterbi first pass, fast or exact. cuda:
# ours, our batch loop around exllamav3's conversion steps with the Hessians kept on the GPU and our
# tile-search kernel (quantizer/codec/exllamav3_batch.py, quantizer/codec/kernel), or exllamav3's own
# conversion: the same codes (docs/encoder.md, "In the quantize stage").
ENCODERS = {"cpu": ("fast", "exact"), "cuda": ("ours", "exllamav3")}


@dataclass(frozen=True)
class QuantizeSettings:
    seed: int = 0
    device: str = "cpu"  # cpu: our codec; cuda: exllamav3's conversion (ours or its own loop)
    encoder: str | None = None  # one of ENCODERS[device]; None: the device's default
    hessians: HessianRecord | None = None  # the Hessians the linears are quantized with; None: without

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise UserError(f"--device {self.device!r}; choose {' or '.join(DEVICES)}")
        if self.encoder is None:
            object.__setattr__(self, "encoder", ENCODERS[self.device][0])
        if self.encoder not in ENCODERS[self.device]:
            raise UserError(f"--encoder {self.encoder} is not an encoder of --device {self.device}; choose "
                            f"{' or '.join(ENCODERS[self.device])}")

    def record(self) -> dict:
        """What job.json pins: a resume with any other value is refused. On cuda both encoders write
        exllamav3's codes bit for bit (tests/gpu/test_encoder_kernel.py), so either resumes the other's cache.
        The Hessians' record keeps the key "calibration", so job files and manifests written before read the same."""
        return {"seed": self.seed, "device": self.device, "encoder": "exllamav3" if self.device == "cuda" else self.encoder,
                "calibration": self.hessians.to_dict() if self.hessians else None, "quantizer_version": __version__}
