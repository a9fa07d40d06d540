"""A repository script (bench/, notebooks/, calibration/, tests/gpu/) loaded as a module, so a test can call
its functions: they are not in the package, so not importable by name."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path


@contextlib.contextmanager
def script_module(path: Path):
    """The script at `path` as a module named after its file, registered in sys.modules while in use (its
    dataclasses look their module up there) and dropped after."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
