"""The fit table of a built pack: in pack/ rather than fit/, since it reads the manifest for the
engine that loads the pack (its loader profile's fit engine), and the pack stage already imports fit."""

from __future__ import annotations

from pathlib import Path

from quantizer.fit.decode import decode_cost
from quantizer.fit.hardware import Hardware, load_hardware
from quantizer.fit.launch import read_launch
from quantizer.fit.memory import fit_table
from quantizer.fit.stored import stored_from_pack
from quantizer.pack.fit_input import plan_of_headers
from quantizer.pack.manifest import Manifest


def pack_fit_table(pack, hardware: Hardware | None = None) -> dict:
    """fit_table of a built pack at its model's full context, from the shards' headers and today's
    hardware profile (or `hardware`), with what a decode token costs on each Spark count (fit/decode.py,
    uniform routing); and, under "planned", the same at the context and streams the pack was fitted to at build
    time (Manifest.planned) where they differ from one stream at the full context: computed when asked, never
    stored with the pack (the profile is re-measured)."""
    cfg, stored = stored_from_pack(pack)
    launch = read_launch(pack)  # a one-Spark pack's launch.env: what its engine copies, whether the drafter runs, CTX
    manifest = Manifest.load(Path(pack))
    profile = manifest.profile  # the pack's engine, no other
    drafter = not launch or launch.drafter
    plan, hw = plan_of_headers(cfg, stored, manifest), hardware or load_hardware()

    def at(context: int, streams: int = 1) -> dict:
        table = fit_table(cfg, stored, context=context, engine=profile.fit_engine, streams=streams,
                          copy_pattern=launch and launch.copy_pattern, mmap_min=launch and launch.mmap_min,
                          drafter="split" if drafter else "off", hardware=hw)
        for sparks, engines in table["topologies"].items():
            for row in engines.values():
                cost = decode_cost(cfg, plan, stored, profile, int(sparks), hw, context, drafter)
                row["decode"] = {"tokens_per_second": round(cost.tokens_per_second, 1),
                                 "with_drafter": cost.with_drafter and round(cost.with_drafter, 1),
                                 "gib_per_token": round(cost.gib_per_token, 3),
                                 "launches_per_token": cost.launches_per_token, "graphed": cost.graphed}
        return table

    table = at(cfg.max_position_embeddings)
    planned = manifest.planned
    table["planned_context"] = planned and planned.context
    if planned and (planned.context < cfg.max_position_embeddings or planned.streams > 1):
        table["planned"] = at(planned.context, planned.streams)
    return table
