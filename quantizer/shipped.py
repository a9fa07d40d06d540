"""Files that ship with the tool: `configs/` (and later the calibration texts) at the repository root.

In a checkout or an editable install they sit beside the package; a wheel carries them inside it
as `quantizer/configs` (see setup.py). One lookup serves both.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def shipped(folder: str, *parts: str) -> Path:
    for base in (_PACKAGE / folder, _PACKAGE.parent / folder):
        if base.is_dir():
            return base.joinpath(*parts)
    raise FileNotFoundError(f"quantizer installation is missing its {folder}/ folder")


def model_config_path(name: str) -> Path:
    """A shipped model shape, e.g. `deepseek-v4.1-flash.json`."""
    return shipped("configs", "models", name)
