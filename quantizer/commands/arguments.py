"""Command-line arguments several commands share: a model shape (a checkpoint or --model-config),
--loader (with --engine, its deprecated hidden alias), the plan options (--codebook; --head-bits and
--drafter-bits, which build takes too), the one-Spark options (--overlay, --overlay-bits, --cold-share), the
calibration's --expert-hessians, --device (cuda where a CUDA GPU is visible, else cpu), token counts such as 1M
and counts of at least 1 (a context of 0 tokens or -1 streams is refused while the arguments are read), and Hugging
Face repository ids and revisions (refused while the arguments are read when the hub would refuse them:
quantizer/hub.py).

Command modules (quantizer/commands/) import this, never each other.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import torch

from quantizer.calibrate.settings import DEVICES, EXPERT_HESSIANS, CalibrationSettings
from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import (
    DEFAULT_OVERLAY,
    EXPERT_LAYOUTS,
    OVERLAY,
    LoaderProfile,
    Overlay,
    check_overlay,
    load_profile,
    loader_for_engine,
    loader_help,
    loader_names,
    parse_overlay,
)
from quantizer.distributed import current
from quantizer.errors import UserError
from quantizer.exl3 import CODEBOOKS
from quantizer.exl3.codebook import Codebook
from quantizer.exl3.k_values import UNQUANTIZED, rate_grid
from quantizer.fit.memory import MARGIN_GIB, FitTarget
from quantizer.hub import branch_problem, repo_id_problem
from quantizer.model.targets import DRAFT, HEAD_GROUP
from quantizer.plan.allocate import AllocationSettings
from quantizer.shipped import model_config_path
from quantizer.workdir import output_problem

_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def tokens(text: str) -> int:
    """`1048576`, `1M` (= 1,048,576) or `128K` (= 131,072); at least one token."""
    m = _TOKENS.match(text)
    n = int(float(m[1]) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m[2].lower()]) if m else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a token count of at least 1, such as 131072, 128K or 1M")
    return n


def count(text: str) -> int:
    """A whole number of at least 1 (streams, rows, columns, chunks)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return n


def out_file(text: str) -> Path:
    """A file to write (a plan, a recipe): not a directory, and no regular file where a parent must be."""
    return Path(_accepted(text, output_problem(Path(text), directory=False)))


def out_dir(text: str) -> Path:
    """A directory to make or fill (a pack, a work directory): not a file, and no file where a parent must be."""
    return Path(_accepted(text, output_problem(Path(text), directory=True)))


def repo_id(text: str) -> str:
    """A Hugging Face repository id, ORG/NAME."""
    return _accepted(text, repo_id_problem(text))


def revision(text: str) -> str:
    """A branch (or tag, or commit) of a Hugging Face repository, by git's rules for a ref name."""
    return _accepted(text, branch_problem(text))


def _accepted(text: str, problem: str | None) -> str:
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text


SRC_HELP = "native checkpoint directory (its config.json is read)"


def add_model_arguments(p: argparse.ArgumentParser, src_help: str = SRC_HELP) -> None:
    p.add_argument("src", nargs="?", help=src_help)
    p.add_argument("--model-config", help="a config.json, or a shipped shape such as deepseek-v4.1-flash")


def profile_arg(text: str) -> LoaderProfile:
    """--loader NAME, resolved where it enters: the profile object is what every later step takes."""
    if text not in loader_names():
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(loader_names())}")
    return load_profile(text)


def add_loader_argument(p: argparse.ArgumentParser, what: str) -> None:
    """--loader, the one flag that names the engine (docs/loader-profiles.md), and --engine, hidden: the
    engine names (vllm, the old name of vllm-exl3, tensorfold, ...) mapped to a profile by `chosen_profile`."""
    p.add_argument("--loader", type=profile_arg, metavar="PROFILE", help=loader_help(what))
    p.add_argument("--engine", help=argparse.SUPPRESS)


def chosen_profile(args: argparse.Namespace) -> LoaderProfile | None:
    """--loader, or the profile the deprecated --engine names (with a one-line note); None where neither."""
    if args.engine is None:
        return args.loader
    loader = loader_for_engine(args.engine)
    if args.loader and args.loader.name != loader:
        raise UserError(f"--engine {args.engine} (loader {loader}) conflicts with --loader {args.loader.name}; "
                        "give --loader alone")
    if current().main:
        sys.stderr.write(f"note: --engine is deprecated; --engine {args.engine} is --loader {loader}\n")
    return load_profile(loader)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codebook", choices=CODEBOOKS, default="mul1")
    add_head_drafter_arguments(p)
    add_layout_arguments(p)


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """--expert-layout and --half-rates: how K may vary over a layer's routed experts (plan/allocate.py), as
    AllocationSettings takes them; the loader profile gives the defaults and refuses what its engine cannot load."""
    p.add_argument("--expert-layout", choices=EXPERT_LAYOUTS,
                   help="routed experts: K per expert and projection (per-expert), a few groups of experts a layer each "
                        "with one K for gate, up and down (grouped), or one K tuple a layer, what the engines' fused "
                        "MoE kernels take (per-layer); default: the loader profile's (docs/decode-speed.md)")
    p.add_argument("--half-rates", action=argparse.BooleanOptionalAction, default=None,
                   help="let K be 1.5, 2.5 or 3.5 (mul1) where the profile allows them (default: the profile's; off "
                        "for exllamav3-v41 until a half-rate pack is shown loading there)")


def add_head_drafter_arguments(p: argparse.ArgumentParser) -> None:
    """--head-bits and --drafter-bits: K of the two groups outside the budget, as AllocationSettings
    takes them (`plan`, `fit` and `build` mean the same by them)."""
    p.add_argument("--head-bits", type=_bits, default=AllocationSettings.head_bits,
                   help=f"K of the LM head (or native; default {AllocationSettings.head_bits:g}); refused where the "
                        "engine keeps the head in source form")
    p.add_argument("--drafter-bits", type=_bits, default=AllocationSettings.drafter_bits,
                   help="K of the DSpark drafter (default native, or the engine profile's where it must be EXL3); "
                        "refused where the engine keeps the drafter in source form")


def add_one_spark_arguments(p: argparse.ArgumentParser) -> None:
    """--overlay, --overlay-bits and --cold-share: what the one-Spark engine (loader exllamav3-v41) takes."""
    p.add_argument("--overlay", nargs="?", const="", metavar="GROUPS",
                   help="loader exllamav3-v41: store these groups as EXL3 instead of the source form, at fixed K outside "
                        f"the budget (default {','.join(DEFAULT_OVERLAY)}: the recipe's attention and drafter overlays, and "
                        "the head at --head-bits unless it is native)")
    p.add_argument("--overlay-bits", type=float, default=Overlay.bits,
                   help=f"K of the overlay's attention side (default {Overlay.bits:g}; the drafter takes --drafter-bits, "
                        f"default {Overlay.drafter_bits:g}, and the head --head-bits)")
    p.add_argument("--cold-share", type=float, default=0.0,
                   help="one Spark: the least-routed experts may stay in the page cache (served from the mapped file, "
                        "read from NVMe when evicted) while they take at most this share of the calibration's routed "
                        "tokens, where that makes the plan fit (default 0: every expert copied into GPU memory)")


def overlay_of(args: argparse.Namespace, profile: LoaderProfile, codebook: str) -> Overlay | None:
    """The overlay the flags ask for under `profile`, checked; None without --overlay."""
    head_bits, drafter_bits = args.head_bits, args.drafter_bits
    if args.overlay is None:
        if args.overlay_bits != Overlay.bits:
            raise UserError("--overlay-bits sets the overlay's K; add --overlay")
        if drafter_bits is not None and profile.layout[DRAFT] == OVERLAY:
            raise UserError(f"--drafter-bits: the {profile.name} engine keeps the drafter in source form unless "
                            "--overlay names it (add --overlay)")
        return None
    overlay = Overlay(parse_overlay(args.overlay, head_bits), float(args.overlay_bits),
                      Overlay.drafter_bits if drafter_bits is None else float(drafter_bits))
    if drafter_bits is not None and DRAFT not in overlay.groups:
        raise UserError(f"--drafter-bits sets the drafter's overlay K, but --overlay {args.overlay} leaves the drafter "
                        "in source form; add drafter to --overlay or drop --drafter-bits")
    return check_overlay(profile, overlay, codebook, head_bits)


def allocation_of(args: argparse.Namespace, profile: LoaderProfile, codebook: str = "mul1",
                  overlay: Overlay | None = None) -> AllocationSettings:
    """The plan flags (--head-bits, --drafter-bits, --expert-layout, --half-rates, and plan's --alias options) as
    the allocator's settings for `profile`, with the overlay the flags ask for."""
    aliasing = {k: getattr(args, k) for k in ("alias", "alias_below", "alias_cap") if hasattr(args, k)}
    for flag, group, k, default in (("--head-bits", HEAD_GROUP, args.head_bits, AllocationSettings.head_bits),
                                    ("--drafter-bits", DRAFT, args.drafter_bits, AllocationSettings.drafter_bits)):
        if k is not None and k != default and not profile.takes_fixed_k(group, overlay):
            raise UserError(f"{flag} {k:g}: the {profile.name} engine keeps the {group} in source form, so it would "
                            f"change nothing; drop {flag} (or choose a --loader that stores the {group} as EXL3)")
    return AllocationSettings(profile=profile, codebook=codebook, head_bits=args.head_bits, drafter_bits=args.drafter_bits,
                              overlay=overlay, expert_layout=args.expert_layout, half_rates=args.half_rates, **aliasing)


def fit_target(args: argparse.Namespace, cfg: ModelConfig, profile: LoaderProfile, sparks: int | None = None,
               context: int | None = None) -> FitTarget | None:
    """--sparks (or `sparks`), --context (else `context`, else the model's max positions), --streams, --cold-share and
    --margin as a fit target on `profile`'s engine; None without a Spark count."""
    sparks = sparks or args.sparks
    if not sparks:
        return None
    return FitTarget(sparks, args.context or context or cfg.max_position_embeddings, args.streams, profile.fit_engine,
                     args.cold_share, args.margin)


def add_expert_hessians(p: argparse.ArgumentParser) -> None:
    """`calibrate` and `build`'s --expert-hessians; an unknown name is refused by CalibrationSettings
    (one line, exit 2)."""
    p.add_argument("--expert-hessians", default=CalibrationSettings.expert_hessians, metavar="|".join(EXPERT_HESSIANS),
                   help="how routed experts' Hessians weight their tokens by the routing weight g (docs/calibration.md): "
                        "gate2 (default), gate, count: gate/up and down both from the expert's routed tokens "
                        "weighted by g^2, g or 1, plus the all-token prior; shared: gate/up read the layer's "
                        "all-token MoE input (exllamav3's; a fifth of gate2's Hessian disk), down the g^2-weighted "
                        "routed tokens")


DEVICE_DEFAULT = "cuda where a CUDA GPU is visible, else cpu"


def add_device_argument(p: argparse.ArgumentParser, what: str) -> None:
    """--device of the commands that run the model (calibrate, build, ppl, eval): on a CUDA machine they run on
    CUDA unless told otherwise. DEVICE_DEFAULT is a string, so argparse hands it to `device` once the command line
    is parsed, and only where --device was not given: no command asks CUDA (which starts its driver) otherwise."""
    p.add_argument("--device", type=device, choices=DEVICES, default=DEVICE_DEFAULT,
                   help=f"{what} (default: {DEVICE_DEFAULT})")


def device(text: str) -> str:
    """--device as given; for its default (that very string object, never a typed one), cuda where torch sees a GPU."""
    if text is DEVICE_DEFAULT:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return text


def add_margin_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--margin", type=_gib, default=MARGIN_GIB, metavar="GIB",
                   help=f"free memory every rank keeps beyond the model's count (default {MARGIN_GIB:g}; 0: none): "
                        f"{what}")


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: GiB as a number >= 0, such as 1 or 0.5")
    return value


def _bits(text: str) -> float | None:
    if text.lower() == "native":
        return None
    try:
        k = float(text)
    except ValueError:
        k = math.nan
    if k != UNQUANTIZED and k not in rate_grid(Codebook.MUL1):
        raise argparse.ArgumentTypeError(f"{text!r}: a K of 1..8, 1.5/2.5/3.5 (mul1), 16 (fp16) or native")
    return k


def load_model_config(src: str | None, model_config: str | None) -> ModelConfig:
    """The model shape from a checkpoint directory, a config.json path, or a shipped name."""
    if bool(src) == bool(model_config):
        raise UserError("give a checkpoint directory or --model-config (one of them)")
    if src:
        return ModelConfig.from_file(Path(src) / "config.json")
    path = Path(model_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        name = model_config if model_config.endswith(".json") else model_config + ".json"
        path = model_config_path(name)
        if not path.exists():
            raise UserError(f"--model-config {model_config}: no such file and no shipped shape of that name "
                            f"(shipped: {', '.join(p.stem for p in path.parent.glob('*.json'))})")
    return ModelConfig.from_file(path)
