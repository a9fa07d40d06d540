"""The pack stage: shards, index, configs and manifest of an EXL3 pack."""

from quantizer.pack.manifest import Manifest
from quantizer.pack.writer import PackSettings, write_pack

__all__ = ["Manifest", "PackSettings", "write_pack"]
