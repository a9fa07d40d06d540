"""Memory and disk a calibration run needs, stated before it starts.

device = streamed forward (estimate_stream_memory: largest block's weights + streams and state of all
         rows + one row chunk's activations)
       + the largest layer's float64 Hessian sums (sum over groups of in^2 * 8; collect.py says why)
       + all-experts extra for one expert on one chunk (its w1/w3/hidden activations in the model dtype
         and a float32 copy of the hidden for the product), when all_experts is on
       + the site-gain recomputation (two chunk-sized stream copies)
       + kept MoE inputs (experts * alias_tokens + sample_tokens rows of hidden_size)
       + a Cholesky workspace and one float32 product for the largest group (4 * in^2 * 4)
ram    = what the host stages for writes and reads: one layer file's packed Hessians, one chunk's
         streams (twice: tensor and bytes) and the largest native tensor read; plus device on the CPU.
disk   = every layer file + the head file + the resume file twice (old and new while it is replaced);
         once complete the resume file is deleted. A layer file holds per group in * 4 (diagonal) +
         in * (in + 1) / 2 * (4, or 2 for float16 routed groups) bytes. With --expert-hessians other
         than shared every routed expert adds a hidden_size-wide group (its own gate/up input) to both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantizer.calibrate.groups import head_group, layer_groups
from quantizer.calibrate.settings import CalibrationSettings
from quantizer.calibrate.storage import STORAGE_DTYPES
from quantizer.checkpoint.config import ModelConfig
from quantizer.model.targets import classified_layout
from quantizer.model.tensor_classes import ENGRAM_TABLE
from quantizer.model.streaming import MemoryEstimate, estimate_stream_memory
from quantizer.report import GIB, gib


@dataclass(frozen=True)
class CalibrationNeeds:
    stream: MemoryEstimate
    hessians: int  # the largest layer's float64 sums
    extras: int  # all-experts activations, site gains, kept inputs, Cholesky workspace
    ram_staging: int  # host memory for writes and reads on CUDA
    layer_files: int  # all layer files and the head file
    resume_file: int

    @property
    def device(self) -> int:
        return self.stream.total + self.hessians + self.extras

    def ram(self, device: str) -> int:
        return self.device + self.ram_staging if device == "cpu" else self.ram_staging

    @property
    def disk(self) -> int:
        return self.layer_files + 2 * self.resume_file

    def describe(self, device: str) -> str:
        where = "RAM" if device == "cpu" else "GPU memory"
        text = (f"calibrate needs ~{_size(self.device)} {where} (forward {_size(self.stream.total)} + Hessian sums "
                f"{_size(self.hessians)} + working {_size(self.extras)})")
        if device != "cpu":
            text += f", ~{_size(self.ram_staging)} RAM"
        return (text + f", ~{_size(self.disk)} disk while running ({_size(self.layer_files)} Hessians kept + "
                f"twice the resume point of {_size(self.resume_file)}, rewritten after each layer)")


def _size(n: int) -> str:
    return f"{gib(n)} GiB" if n >= GIB else f"{n / (1 << 20):,.1f} MiB"


def stored_bytes(size: int, dtype: torch.dtype) -> int:
    return size * 4 + size * (size + 1) // 2 * dtype.itemsize


def calibration_needs(cfg: ModelConfig, rows: int, cols: int, settings: CalibrationSettings) -> CalibrationNeeds:
    dtype = settings.dtype
    item = dtype.itemsize
    chunk = settings.chunk_rows(rows, cols)
    stream = estimate_stream_memory(cfg, rows, cols, dtype, chunk)
    chunk_tokens = chunk * cols
    layers = [layer_groups(cfg, layer, settings.expert_inputs) for layer in range(cfg.num_layers)]
    head = head_group(cfg)
    sums = max((sum(8 * g.size ** 2 for g in groups) for groups in layers), default=0)
    if head is not None:
        sums = max(sums, 8 * head.size ** 2)
    largest = max([g.size for groups in layers for g in groups] + [head.size if head else 0])
    all_experts = chunk_tokens * cfg.moe_intermediate_size * (3 * item + 4) if settings.all_experts else 0
    site = 2 * chunk_tokens * cfg.hc_mult * cfg.hidden_size * 4
    kept = (cfg.experts_in("layers") * settings.alias_tokens + settings.sample_tokens) * cfg.hidden_size * item
    extras = all_experts + site + kept + 4 * 4 * largest ** 2
    expert_dtype = STORAGE_DTYPES[settings.expert_hessian_dtype]
    files = [sum(stored_bytes(g.size, expert_dtype if g.routed else torch.float32) for g in groups)
             for groups in layers]
    head_file = stored_bytes(head.size, torch.float32) if head else 0
    chunk_streams = chunk_tokens * cfg.hc_mult * cfg.hidden_size * 4
    largest_native = max(spec.nbytes for spec, cls in classified_layout(cfg) if cls != ENGRAM_TABLE)
    staging = max(files, default=0) + 2 * chunk_streams + largest_native
    return CalibrationNeeds(stream, sums, extras, staging, sum(files) + head_file, stream.states)
