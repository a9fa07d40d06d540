"""What a tuning run is made with (block-wise, and end to end); its record goes into the manifest."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from quantizer.errors import UserError

INPUTS = ("native", "quantized")  # where block L's inputs come from: the native model, or the tuned blocks < L
# What block L's output is fitted to: the native block on the same inputs, or the native model's own stream
# after block L (with quantized inputs, the latter also asks block L to undo the error of the blocks before)
TARGETS = ("block", "model")


@dataclass(frozen=True)
class TuneSettings:
    # Defaults from measurement on the bundled small V4.1 model (docs/tuning.md): lr 3e-3 on 2 rows a step
    # kept improving a block for 30 steps, lr 1e-2 on 1 row did not improve its first block at all; steps
    # are few because a CPU step of one block costs seconds.
    steps: int = 20  # Adam steps per block at most (the best held-out step is kept)
    lr: float = 3e-3  # on the relative change of each scale (suh = suh0 * (1 + a))
    batch_rows: int = 2  # calibration rows per Adam step
    heldout: float = 0.25  # share of the calibration rows held out for early stopping (at least one row)
    heldout_rows: int = 16  # held-out rows at most (each measurement runs them all)
    eval_every: int = 5  # steps between held-out measurements
    patience: int = 2  # held-out measurements without improvement before a block stops
    inputs: str = "native"
    target: str = "block"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.inputs not in INPUTS:
            raise UserError(f"tune inputs {self.inputs!r}; choose {' or '.join(INPUTS)}")
        if self.target not in TARGETS:
            raise UserError(f"tune target {self.target!r}; choose {' or '.join(TARGETS)}")
        if self.target == "model" and self.inputs != "quantized":
            raise UserError("tune target model differs from block only with quantized inputs")
        if min(self.steps, self.batch_rows, self.heldout_rows, self.eval_every, self.patience) < 1 or self.lr <= 0:
            raise UserError("tune: steps, batch rows, held-out rows, eval interval and patience must be at least 1, "
                            "lr above 0")
        if not 0 < self.heldout < 1:
            raise UserError(f"tune: held-out share {self.heldout} must lie between 0 and 1")

    def split(self, rows: int) -> tuple[int, int]:
        """(tuning rows, held-out rows) of `rows` calibration rows: the first rows and the last ones, as
        split_rows splits them, the tuning rows no more than `steps` steps of `batch_rows` can draw and the
        held-out ones at most `heldout_rows`. The stage holds every row it uses (tune_memory), so a real
        build's 250 calibration rows do not all have to fit beside a block."""
        tune, held = split_rows(rows, self.heldout, "--tune")
        return min(tune, self.steps * self.batch_rows), min(held, self.heldout_rows)

    def record(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EndToEndSettings:
    """`build --tune-e2e` (end_to_end.py). Defaults from measurement on the bundled small V4 model at
    2.0 bpw in our forward (docs/tuning.md): one 2048-token row a step, the held-out KL fell 11% and
    levelled off after about 75 steps at lr 2e-3 and 100 at 1e-3; tuning the norms as well gained
    nothing more, so only the scales move."""

    steps: int = 150  # Adam steps at most (the best held-out measurement is kept)
    lr: float = 2e-3  # on the relative change of each scale, as block-wise
    batch_rows: int = 1
    heldout: float = 0.25  # the block-wise stage's split: the same rows are held out by both
    eval_every: int = 25
    patience: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_rows < 1 or self.eval_every < 1 or self.patience < 1 or self.lr <= 0:
            raise UserError("--tune-e2e: steps, batch rows, eval interval and patience must be at least 1, lr above 0")
        if not 0 < self.heldout < 1:
            raise UserError(f"--tune-e2e: held-out share {self.heldout} must lie between 0 and 1")

    def split(self, rows: int) -> tuple[int, int]:
        return split_rows(rows, self.heldout, "--tune-e2e")

    def record(self) -> dict:
        return asdict(self)


def split_rows(rows: int, heldout: float, flag: str) -> tuple[int, int]:
    """(tuning rows, held-out rows): the last `heldout` share of the rows (at least one) is held out."""
    held = max(1, round(rows * heldout))
    if rows - held < 1:
        raise UserError(f"{flag} needs at least 2 calibration rows (one to tune on, one held out); got {rows}")
    return rows - held, held
