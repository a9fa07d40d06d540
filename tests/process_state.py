"""What a test can change in its process and forget to restore (used by tests/gpu/conftest.py and
checked on the CPU by tests/test_process_state.py)."""

from __future__ import annotations

import hashlib
import os

import torch

# pytest sets the first for every test it runs; torch's inductor records its cache directory in the
# second the first time anything in the process compiles (exllamav3's triton kernels), once.
_ENV_IGNORED = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]


def snapshot() -> dict[str, object]:
    state: dict[str, object] = {
        "torch CPU random generator": _digest(torch.get_rng_state()),
        "torch threads": torch.get_num_threads(),
        "torch default dtype": torch.get_default_dtype(),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "grad enabled": torch.is_grad_enabled(),
        "cuda matmul allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cuda matmul fp16 reduced precision": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "cuda matmul bf16 reduced precision": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "cudnn allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn benchmark": torch.backends.cudnn.benchmark,
        "cudnn deterministic": torch.backends.cudnn.deterministic,
        "environment": {k: v for k, v in os.environ.items() if k not in _ENV_IGNORED},
        "working directory": os.getcwd(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["current CUDA device"] = torch.cuda.current_device()
        state["torch CUDA random generators"] = [_digest(s) for s in torch.cuda.get_rng_state_all()]
    return state


def state_changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """One line per changed item (CUDA state appears once CUDA is first used: not a change)."""
    changes = []
    for key, old in before.items():
        new = after.get(key)
        if key == "environment":
            keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if keys:
                changes.append(f"environment variables {', '.join(keys)}")
        elif new != old:
            changes.append(f"{key}: {old} -> {new}")
    return changes
