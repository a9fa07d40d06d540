"""The fit table of a built pack: in pack/ rather than fit/, since it reads the manifest for the
engine that loads the pack (its loader profile's fit engine), and the pack stage already imports fit."""

from __future__ import annotations

from pathlib import Path

from quantizer.contract.loader_profiles import load_profile
from quantizer.fit.launch import read_launch
from quantizer.fit.memory import fit_table
from quantizer.fit.stored import stored_from_pack
from quantizer.pack.manifest import Manifest


def pack_fit_table(pack) -> dict:
    """fit_table of a built pack at its model's full context, from the shards' headers and today's
    hardware profile: computed when asked, never stored with the pack (the profile is re-measured)."""
    cfg, stored = stored_from_pack(pack)
    launch = read_launch(pack)  # a one-Spark pack's launch.env: what its engine copies, and whether the drafter runs
    copy, drafter = launch if launch else (None, True)
    engine = load_profile(Manifest.load(Path(pack)).plan["loader"]).fit_engine  # the pack's engine, no other
    return fit_table(cfg, stored, context=cfg.max_position_embeddings, engine=engine, copy_pattern=copy,
                     drafter="split" if drafter else "off")
