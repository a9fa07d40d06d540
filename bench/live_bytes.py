"""Live torch tensor bytes per device type, exactly, and their peak per phase.

A TorchDispatchMode sees every tensor an op makes or reads; each new storage is counted once (by
its Python storage object, which torch keeps alive exactly as long as the storage itself) and
uncounted by a finalizer when the storage is freed. Allocations inside one kernel (a library's
workspace) are not tensors and are not seen; everything the calibration code holds is.

Each storage is labelled with the phase it was made in (set by the caller), the row chunk being run
then (`chunk`, advanced by the caller) and the innermost quantizer function that made it, so a peak
can be broken down by what was alive at that moment.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PACKAGE = str(Path(__file__).resolve().parents[1] / "quantizer")

Label = tuple[str, int, str]  # (phase made in, chunk made in, site)


@dataclass
class Peak:
    bytes: int = 0
    chunk: int = 0  # the row chunk being run at the peak
    by_label: dict[Label, int] = field(default_factory=dict)  # what was alive then


class LiveBytes(TorchDispatchMode):
    """with LiveBytes() as live: ...; live.peak["cpu"].bytes, live.phases[name]["cpu"] (a Peak)."""

    def __init__(self, device_types: tuple[str, ...] = ("cpu",), lines: bool = False):
        super().__init__()
        self.device_types, self.lines = device_types, lines
        self.now = dict.fromkeys(device_types, 0)
        self.live: dict[int, tuple[str, int, Label]] = {}  # id(storage) -> (device type, bytes, label)
        self.by_label: dict[str, dict[Label, int]] = {d: {} for d in device_types}
        self.phase, self.chunk = "start", 0
        self.peak = {d: Peak() for d in device_types}
        self.phases: dict[str, dict[str, Peak]] = {}

    @contextmanager
    def in_phase(self, name: str):
        """Storages made inside are labelled `name`; the phase's peak is the highest total seen in it."""
        outer, self.phase = self.phase, name
        self._note_peak()
        try:
            yield
        finally:
            self.phase = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self._see(t)
        self._note_peak()
        return out

    def _see(self, t: torch.Tensor) -> None:
        kind = t.device.type
        if kind not in self.now:
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        if size == 0:
            return
        label = (self.phase, self.chunk, _site(self.lines))
        self.live[key] = (kind, size, label)
        counts = self.by_label[kind]
        counts[label] = counts.get(label, 0) + size
        self.now[kind] += size
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        kind, size, label = self.live.pop(key)
        self.now[kind] -= size
        self.by_label[kind][label] -= size

    def _note_peak(self) -> None:
        phase = self.phases.setdefault(self.phase, {d: Peak() for d in self.device_types})
        for kind, now in self.now.items():
            for peak in (self.peak[kind], phase[kind]):
                if now > peak.bytes:
                    peak.bytes, peak.chunk = now, self.chunk
                    peak.by_label = {k: v for k, v in self.by_label[kind].items() if v}


def _site(lines: bool) -> str:
    """module.function (:line) of the innermost frame in the quantizer package (or 'outside')."""
    frame = sys._getframe(3)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            return f"{Path(path).stem}.{frame.f_code.co_name}" + (f":{frame.f_lineno}" if lines else "")
        frame = frame.f_back
    return "outside"
