"""Make `.device-cache/`, the GPU machine's exllamav3 kit, small enough to travel with the repository.

The GPU machine starts bare and the device tool carries at most 64 MiB: the working tree (about 41 MB
with the three bundled models) plus the kit as it is handed out (about 37 MB, 26 MB of it the prebuilt
exllamav3 extension in two parts) is over that. This copies the kit's wheels, stores the extension
xz-compressed (about 14 MB) and writes a setup.sh that installs the wheels and unpacks the extension
there, in seconds instead of exllamav3's 4-minute compile:

    python tests/gpu/device_cache.py KIT          # KIT: the kit's folder (*.whl, exllamav3_ext.so.*)
    # on the GPU machine, .device-cache carried:
    source .device-cache/setup.sh && python3 -m pytest tests/gpu -q

`.device-cache/` must be ignored by git (it is in .gitignore) and named in the call's carry.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXTENSION = "exllamav3_ext.so.xz"
# The extension was built for this interpreter and torch; elsewhere exllamav3 compiles its own.
SETUP = """# Source on the GPU machine: installs the carried wheels into /tmp/site and unpacks the prebuilt
# exllamav3 extension there (written by tests/gpu/device_cache.py).
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$_here"/*.whl || return 1
_py=$(python3 -c 'import sys; print(f"{sys.version_info.major}{sys.version_info.minor}")')
_torch=$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')
if [ "$_py" = "312" ] && [ "$_torch" = "2.11.0" ]; then
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \\
    "$_here/exllamav3_ext.so.xz" /tmp/site/exllamav3_ext.cpython-312-x86_64-linux-gnu.so || return 1
else
  echo "setup.sh: python $_py / torch $_torch are not what the extension was built for; exllamav3 compiles it (~4 min)" >&2
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
"""


def make(kit: Path, out: Path) -> int:
    """Write the compact kit to `out`; its size in bytes."""
    wheels = sorted(kit.glob("*.whl"))
    parts = sorted(kit.glob("exllamav3_ext.so.[0-9]*"))
    if not wheels or not parts:
        raise SystemExit(f"device_cache: {kit} holds no *.whl or no exllamav3_ext.so.* parts: not the kit's folder")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file():
            stale.unlink()
    for wheel in wheels:
        shutil.copy2(wheel, out / wheel.name)
    with lzma.open(out / EXTENSION, "wb", preset=6) as packed:
        for part in parts:  # the parts are one file cut in order
            with part.open("rb") as f:
                shutil.copyfileobj(f, packed)
    (out / "setup.sh").write_text(SETUP)
    return sum(f.stat().st_size for f in out.iterdir())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kit", type=Path, help="the kit's folder: exllamav3 and its wheels, exllamav3_ext.so.00, .01")
    ap.add_argument("--out", type=Path, default=REPO / ".device-cache")
    args = ap.parse_args(argv)
    size = make(args.kit, args.out)
    print(f"{args.out}: {size / 2**20:.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
