"""Loader profiles: what an engine takes in a pack, read from `configs/loaders/<name>.json` (every rule
with the engine source it comes from; docs/loader-profiles.md). A profile covers the pack's layout as
well as K: which target groups are EXL3 and which stay in the source's form byte for byte, the dtype
plain tensors must have, dtypes the model directory may not hold, where the Engram tables go, and the
`quantization_config` the engine reads from config.json.

The allocator optimises inside a profile (allocate.py) and budgets only the groups it quantizes,
`make_plan` refuses a plan that breaks it, the pack spec (pack_spec.py) lays a pack out by it, and
`quantizer verify --loader` checks a written pack against it. The rules on stored linears, each with
its K (None: source form, 16: fp16) and codebook:

- `layout`: a group the engine reads as EXL3 is EXL3, a group it reads in source form stays so; an
  `overlay` group stays in source form unless the user asks for the overlay (`--overlay`), which makes
  it EXL3 at a fixed K outside the budget (native ExLlamaV3's V4.1 loader: Overlay below);
- `codebook`: quantized linears use a codebook the engine's kernels decode;
- `k_range`: quantized K within [k_min, k_max] (16 = fp16 where `fp16_linears`);
- `half_rates`: half-integer K only with `half_rate_codebooks`;
- `integer_attention`: DSV4 attention, compressor and indexer linears take integer K;
- `head_bits`: an integer K for the head where the engine reads head_bits as an integer;
- `one_k_per_projection`: the routed experts of one layer share one K per projection;
- `gate_up_tied`: gate (w1) and up (w3) of a layer's routed experts share one K;
- `aliases`: whether cold experts may be served by another expert's tensors.
Pack-level rules (verify/checks.py): `plain_dtypes`, `forbidden_dtypes`, `engram_tables`,
`quantization_config`, `required_config_keys`, `architectures`, `required_files`, `index`; and
`sparks`: the Spark counts the engine runs on (a plan for another count is refused).

The profile is the engine as one object: resolved once where a name enters (a command's --loader, plan.json,
a manifest) and passed as the object after that. Besides its rules it owns what differs by engine elsewhere:
the `quantization_config` the engine reads (`engine_quantization_config`), the card's run section and Hub tags
(`card`), whether the demo plans for it, which model and Spark count it is the default for, and its --loader help.
A profile is one JSON file: the shipped ones in configs/loaders/, and any in the directory $QUANTIZER_LOADERS
names (an engine of one's own, tests/test_fifth_profile.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from quantizer.caches import process_cache, value_hash
from quantizer.checkpoint.config import V4, ModelConfig
from quantizer.contract.engine_config import EXLLAMAV3_FORM, fill_template, template_values
from quantizer.contract.stored_linear import StoredLinear
from quantizer.errors import UserError
from quantizer.exl3 import UNQUANTIZED, check_k, drafter_k
from quantizer.model.targets import ATTN, BUDGETED_GROUPS, DRAFT, ENGRAM, GROUPS, HEAD_GROUP, INDEX, ROUTED, SHARED, Target
from quantizer.shipped import shipped

EXLLAMAV3 = "exllamav3"  # stock exllamav3: the EXL3 format's own engine, the baseline converter's target
VLLM_EXL3 = "vllm-exl3"
TENSORFOLD = "tensorfold"
EXLLAMAV3_V41 = "exllamav3-v41"
EXTRA_PROFILES = "QUANTIZER_LOADERS"  # a directory of further profile JSON files
EXL3_FORM, SOURCE_FORM, EITHER, OVERLAY = "exl3", "source", "either", "overlay"
ENGRAM_IN_PACK, ENGRAM_SIBLING = "pack", "sibling"
RULES = ("layout", "codebook", "k_range", "half_rates", "integer_attention", "head_bits",
         "one_k_per_projection", "gate_up_tied", "aliases", "plain_dtypes", "forbidden_dtypes", "engram_tables",
         "quantization_config", "required_config_keys", "architectures", "required_files", "index", "sparks")


@dataclass(frozen=True)
class PlainDtype:
    """A plain (non-linear) tensor the engine reads in one of `accept`; stored as `dtype` otherwise."""

    match: str  # fnmatch pattern on the tensor name
    dtype: str
    accept: tuple[str, ...]


PER_EXPERT, GROUPED, PER_LAYER = "per-expert", "grouped", "per-layer"
EXPERT_LAYOUTS = (PER_EXPERT, GROUPED, PER_LAYER)
GATE_UP, ALL_PROJECTIONS = "gate+up", "all"


@dataclass(frozen=True)
class ExpertLayout:
    """How the allocator may vary K over a layer's routed experts (plan/allocate.py): per expert and projection;
    in `groups` groups of at least `min_group` experts, each one K for gate, up and down; or one K tuple per
    layer, `tie` saying whether gate and up share it (gate+up) or all three projections do (all), as the engine's
    fused MoE path takes a layer."""

    name: str
    tie: str = GATE_UP
    groups: int = 4
    min_group: int = 4

    def describe(self) -> str:
        if self.name == PER_LAYER:
            return "one K per layer" + (" for gate, up and down" if self.tie == ALL_PROJECTIONS else
                                        " per projection, gate = up")
        if self.name == GROUPED:
            return f"in {self.groups} groups per layer of at least {self.min_group} experts, gate = up = down"
        return "K per expert and projection"


@dataclass(frozen=True)
class Layouts:
    """A profile's expert layouts: the one it defaults to, those its engine loads, the tie of its fused path,
    and whether half rates are on by default; each with the numbers and engine code behind it."""

    default: str
    allowed: tuple[str, ...]
    fused_tie: str
    half_rates: bool
    source: str
    groups: int = 4
    min_group: int = 4


@dataclass(frozen=True)
class Dispatch:
    """How the engine runs a decode step (fit/decode.py), read from its code: kernel launches per token and per
    layer outside the routed MoE, those of its fused MoE path (every expert of a layer on the fused tie's K tuple)
    and of its mixed-K path (fixed, and per expert the rows select), whether a mixed layer still takes one fused
    launch (TensorFold: per-expert K tables), when the step runs inside CUDA graphs (none, fused: only where every
    layer is fused, all), the rows its drafter proposes a round, and whether it drafts at all once a layer is
    mixed."""

    token_launches: int
    layer_launches: int
    fused_launches: int
    mixed_launches: int
    mixed_per_expert: int
    mixed_is_fused: bool
    graphs: str
    draft: int
    mixed_drafts: bool  # whether the drafter may run where a layer takes the mixed-K path
    source: str


RUN_SECTIONS = ("exllamav3", "vllm", "tensorfold", "mapped")  # the card's run-section writers (pack/card.py)
RUN_STEPS = ("install", "join", "launch", "started")  # a runbook's kinds of step (the pack's download is the card's)
RUN_VALUES = ("name", "repo", "revision", "context", "streams", "tokens", "sparks", "engram")  # {{key}} in a step
_SOURCE = re.compile(r"^[\w.-]+/[\w.-]+ \S+ @[0-9a-f]{7,40}\b")  # owner/name path @commit, then more


@dataclass(frozen=True)
class RunStep:
    """One step of the card's runbook, read from the engine's public code: what it does (`say`), the command lines
    (`{{key}}` filled from the pack, RUN_VALUES), the file it comes from (repository, path, commit) and, where it
    differs by topology, the Spark counts it is for (docs/loader-profiles.md, "The card's runbook")."""

    step: str
    say: str
    commands: tuple[str, ...]
    source: str
    sparks: tuple[int, ...] = ()  # empty: every Spark count
    language: str = ""

    def lines(self, values: dict[str, str]) -> tuple[str, str, tuple[str, ...]]:
        """The step's words, source and command lines with the pack's values filled in."""
        def fill(text: str) -> str:
            for key, value in values.items():
                text = text.replace("{{" + key + "}}", value)
            return text
        return fill(self.say), self.source, tuple(fill(c) for c in self.commands)


@dataclass(frozen=True)
class CardInfo:
    """What the pack's card says of the engine: Hugging Face's library_name (only for the engine that library
    names), extra tags, which run-section writer describes the launch (one per launch shape: stock
    exllamav3, vLLM's serve, TensorFold's launcher, the mapped one-Spark launch) and its runbook (none: the card
    says the launch is not known)."""

    library_name: str | None
    tags: tuple[str, ...]
    run: str
    runbook: tuple[RunStep, ...] = ()


@dataclass(frozen=True)
class DefaultFor:
    """A model architecture (and Spark counts, None: any) for which this profile is the default engine."""

    arch: str
    sparks: tuple[int, ...] | None = None

    def matches(self, arch: str, sparks: int | None) -> bool:
        return arch == self.arch and (self.sparks is None or sparks in self.sparks)


@dataclass(frozen=True)
class LoaderProfile:
    name: str
    engine: str
    archs: tuple[str, ...]  # model architectures the engine runs
    fit_engine: str  # the engine profile of configs/hardware the fit charges (runtime, KV)
    codebooks: tuple[str, ...]
    k_min: float
    k_max: float
    fp16_linears: bool
    half_rate_codebooks: tuple[str, ...]
    integer_attention: bool
    per_expert_k: bool
    tie_gate_up: bool
    aliases: bool
    layout: dict[str, str]  # target group -> exl3 | source | either | overlay
    integer_head: bool
    default_drafter_bits: float | None  # where the drafter must be EXL3
    engram_tables: str  # pack (linked into the pack) | sibling (a directory beside it)
    pack_align: int  # shard tensor alignment: 64 with pad tensors, or 1 (no pad tensor in any header)
    forbidden_dtypes: tuple[str, ...]  # dtypes no tensor of the model directory may have
    plain_dtypes: tuple[PlainDtype, ...]
    quantization_config: dict | str  # a template (placeholders `$...`, pack/exl3_config.py) or "exllamav3"
    config_bits_range: tuple[int, int]  # what the engine accepts as the config's integer `bits`
    required_config_keys: tuple[str, ...]  # config.json keys the engine reads ("text_config.x": in text_config)
    sources: dict[str, str]
    sparks: tuple[int, ...] = (1, 2, 4)  # Spark counts the engine runs on
    architectures: tuple[str, ...] = ()  # config.json's `architectures` exactly, where the engine asserts it
    required_files: tuple[str, ...] = ()  # files the engine reads from the pack directory besides the shards
    ignored: dict[str, str] = field(default_factory=dict)  # what the engine does not read, and where that is seen
    layouts: Layouts = Layouts(PER_EXPERT, EXPERT_LAYOUTS, GATE_UP, True, "")  # the allocator's expert layouts
    decode: Dispatch | None = None  # how its engine runs a decode step (fit/decode.py)
    help: str = ""  # one line for --loader's help
    order: int = 0  # where it sorts among profiles (help, demo rows)
    default_for: tuple[DefaultFor, ...] = ()
    demo: bool = False  # whether `quantizer demo` plans ours for it
    card: CardInfo = CardInfo(None, (), "exllamav3")

    __hash__ = value_hash  # its rule sources are a dict

    def quantizes(self, group: str) -> bool:
        """Whether the engine may read this target group as EXL3."""
        return self.layout[group] != SOURCE_FORM

    def budgets(self, t: Target) -> bool:
        """Whether `t` counts against the bpw budget: exllamav3's budgeted set, less what the engine keeps
        in source form or takes as an overlay at a fixed K (for vllm-exl3 and exllamav3-v41 the routed
        experts alone; the rest is a fixed cost in bytes)."""
        return t.group in self.budgeted_groups

    @property
    def budgeted_groups(self) -> tuple[str, ...]:
        """The target groups whose bits the bpw counts (exllamav3's budgeted set, less the engine's source form)."""
        return tuple(g for g in BUDGETED_GROUPS if self.layout[g] in (EXL3_FORM, EITHER))

    @property
    def bits_measure(self) -> str:
        """The one name of the number --bpw sets for this engine, printed beside it everywhere (README.md, Words):
        bits per routed weight where the budget is the routed experts alone, else over which tensors."""
        groups = self.budgeted_groups
        return "bits per routed weight" if groups == ("routed",) else f"bits over the budgeted tensors ({', '.join(groups)})"

    @property
    def overlay_groups(self) -> tuple[str, ...]:
        """The groups the engine reads in source form unless an EXL3 overlay is asked for."""
        return tuple(g for g in GROUPS if self.layout[g] == OVERLAY)

    def fixed_k(self, t: Target, head_bits: float | None, drafter_bits: float | None,
                overlay: Overlay | None = None) -> float | None:
        """K of a target the allocator does not budget: the head and drafter by their flags (or the
        overlay), an overlay group at the overlay's K, None (source form) otherwise."""
        form = self.layout[t.group]
        if form == OVERLAY:
            return overlay.k(t, head_bits, drafter_bits) if overlay and t.group in overlay.groups else None
        if t.group == HEAD_GROUP:
            return self.group_k(HEAD_GROUP, head_bits)
        if t.group == DRAFT:
            return drafter_k(self.group_k(DRAFT, drafter_bits), t.integer_only)
        return None

    def integer_only(self, t: Target) -> bool:
        return (self.integer_attention and t.integer_only) or (self.integer_head and t.group == HEAD_GROUP)

    def allows_k(self, k: float, codebook: str, t: Target) -> bool:
        """Whether one linear of target `t` may hold K `k` under this profile (a unit's own rule)."""
        if not self.quantizes(t.group):
            return False
        if k == UNQUANTIZED:
            return self.fp16_linears
        half = k != int(k)
        return (codebook in self.codebooks and self.k_min <= k <= self.k_max
                and not (half and (codebook not in self.half_rate_codebooks or self.integer_only(t))))

    def takes_fixed_k(self, group: str, overlay: Overlay | None) -> bool:
        """Whether a K asked for the head or drafter changes the pack: not where the engine keeps the group in
        source form, nor for an overlay group the overlay leaves out."""
        if self.layout[group] == OVERLAY:
            return overlay is not None and group in overlay.groups
        return self.quantizes(group)

    def group_k(self, group: str, wanted: float | None) -> float | None:
        """K for the head or drafter group: None where the engine keeps it in source form, the
        profile's default where it must be EXL3 and none was asked for."""
        if not self.quantizes(group):
            return None
        if wanted is None and self.layout[group] == EXL3_FORM and group == DRAFT:
            return self.default_drafter_bits
        return wanted

    def plain_dtype(self, name: str, dtype: str) -> str:
        """The dtype a plain tensor is stored in: its own, or the one the engine's loader converts from."""
        for rule in self.plain_dtypes:
            if fnmatchcase(name, rule.match):
                return dtype if dtype in rule.accept else rule.dtype
        return dtype

    def expert_layout(self, name: str | None) -> ExpertLayout:
        """The layout `name` (None: the profile's default), or a one-line UserError where the engine cannot load it."""
        name = name or self.layouts.default
        if name not in EXPERT_LAYOUTS:
            raise UserError(f"--expert-layout {name}: choose one of {', '.join(EXPERT_LAYOUTS)}")
        if name not in self.layouts.allowed:
            raise UserError(f"--expert-layout {name}: the {self.name} engine loads {' or '.join(self.layouts.allowed)} "
                            f"only ({self.sources['one_k_per_projection']})")
        return ExpertLayout(name, self.layouts.fused_tie, self.layouts.groups, self.layouts.min_group)

    def check_arch(self, cfg: ModelConfig) -> None:
        if cfg.arch not in self.archs:
            raise UserError(f"--loader {self.name}: {self.engine.split(':')[0]} runs {' and '.join(self.archs)} "
                            f"models, this one is {cfg.arch}; use --loader {default_profile(cfg).name}")

    def engine_quantization_config(self, qcfg: dict, source_config: dict, cfg: ModelConfig,
                                   linears: list[StoredLinear]) -> dict:
        """The quantization_config the engine reads: exllamav3's record, or the profile's template filled from
        the stored linears (contract/engine_config.py). The pack writer writes it, verify refills it from the shards."""
        if self.quantization_config == EXLLAMAV3_FORM:
            return qcfg
        return fill_template(self.quantization_config, template_values(qcfg, source_config, cfg, linears,
                                                                       self.config_bits_range))

    @property
    def is_stock(self) -> bool:
        """Whether this is stock exllamav3, whose own allocator the exl3 method mirrors."""
        return self.name == EXLLAMAV3

    def check_sparks(self, sparks: int) -> None:
        """UserError when the engine does not run on this many Sparks (a plan for it could not be served)."""
        if sparks not in self.sparks:
            counts = " or ".join(str(n) for n in self.sparks)
            raise UserError(f"--sparks {sparks}: the {self.name} engine runs on {counts} Spark(s) only "
                            f"({self.sources['sparks']}); {_sparks_hint(sparks)}")


def _sparks_hint(sparks: int) -> str:
    other = [p.name for p in all_profiles() if sparks in p.sparks and p.name != EXLLAMAV3]
    return f"use --loader {' or '.join(other)} for {sparks} Spark(s)" if other else "choose another Spark count"


@dataclass(frozen=True)
class Overlay:
    """EXL3 in place of the source form for whole groups, at fixed K outside the budget: what the recipe's
    overlay scripts add beside a one-Spark pack (docs/loader-profiles.md, exllamav3-v41)."""

    groups: tuple[str, ...]
    bits: float = 5.0  # the attention side: attention (with compressor), indexer, shared experts, Engram wkv
    drafter_bits: float = 4.0  # the drafter's linears, unless --drafter-bits says otherwise

    def k(self, t: Target, head_bits: float | None, drafter_bits: float | None) -> float | None:
        if t.group == HEAD_GROUP:
            return head_bits
        if t.group == DRAFT:
            return drafter_k(self.drafter_bits if drafter_bits is None else drafter_bits, t.integer_only)
        return self.bits


def overlay_note(overlay: Overlay | None) -> str:
    """The overlay as a plan's made_by names it."""
    if not overlay:
        return ""
    side = [g for g in overlay.groups if g != DRAFT]
    drafter = f"the drafter at {overlay.drafter_bits:g} bits" if DRAFT in overlay.groups else ""
    return ", an EXL3 overlay: " + " and ".join(filter(None, [side and f"{', '.join(side)} at {overlay.bits:g} bits", drafter]))


OVERLAY_SIDE = (ATTN, INDEX, SHARED, ENGRAM)  # requant_attn_exl3.py's targets
DEFAULT_OVERLAY = OVERLAY_SIDE + (DRAFT,)  # and requant_mtp_exl3.py's: the overlay the recipe measured


def parse_overlay(text: str | None, head_bits: float | None = None) -> tuple[str, ...]:
    """`--overlay` or `--overlay attention,drafter,head`. `--overlay` alone is the recipe's overlay and, with a head
    K (--head-bits, 6 by default), the head: an fp16 head is read twice a speculative round, and at K6 the model
    prices it 2% faster without the drafter and 4% with it, with 0.77 GiB more for the experts (docs/decode-speed.md)."""
    if not text:
        return DEFAULT_OVERLAY + ((HEAD_GROUP,) if head_bits is not None else ())
    return tuple(dict.fromkeys(g.strip() for g in text.split(",") if g.strip()))


def check_overlay(profile: LoaderProfile, overlay: Overlay, codebook: str, head_bits: float | None) -> Overlay:
    """The overlay as asked, or a one-line UserError: a profile without overlay groups, a group the engine
    keeps in one form only, or a K the engine cannot load there."""
    where = profile.overlay_groups
    if not where:
        raise UserError(f"--overlay: the {profile.name} engine reads every group in one form (docs/loader-profiles.md); "
                        f"an EXL3 overlay is for --loader {EXLLAMAV3_V41}")
    for g in overlay.groups:
        if g not in where:
            kept = "always EXL3 there" if g in GROUPS and profile.layout[g] == EXL3_FORM else \
                "kept in source form by the engine (embedding, router, norms, mHC and Engram tables have no EXL3 path)"
            raise UserError(f"--overlay {g}: not a group the {profile.name} engine takes as an overlay ({kept}); "
                            f"choose from {', '.join(where)}")
    check_k(overlay.bits, codebook, True, "--overlay-bits")
    check_k(overlay.drafter_bits, codebook, False, "--drafter-bits")
    if HEAD_GROUP in overlay.groups:
        if head_bits is None:
            raise UserError("--overlay head with --head-bits native: give the head an EXL3 K, or leave it out of --overlay")
        check_k(head_bits, codebook, profile.integer_head, "--head-bits")
    for k in (overlay.bits, overlay.drafter_bits, head_bits if HEAD_GROUP in overlay.groups else None):
        if k is not None and not profile.k_min <= k <= profile.k_max:
            raise UserError(f"overlay K {k:g}: the {profile.name} engine loads K {profile.k_min:g}..{profile.k_max:g} "
                            f"({profile.sources['k_range']})")
    return overlay


def _profile_files() -> dict[str, Path]:
    """name -> JSON file of every profile: the shipped ones, then those in $QUANTIZER_LOADERS (a name there
    replaces no shipped one)."""
    files = {p.stem: p for p in sorted(shipped("configs", "loaders").glob("*.json"))}
    extra = os.environ.get(EXTRA_PROFILES)
    if extra:
        if not Path(extra).is_dir():
            raise UserError(f"${EXTRA_PROFILES}={extra}: not a directory; name the folder that holds your profile JSON files")
        for p in sorted(Path(extra).glob("*.json")):
            if p.stem in files:
                raise UserError(f"${EXTRA_PROFILES}: {p} has the name of a shipped loader profile; give it its own")
            files.setdefault(p.stem, p)
    return files


@process_cache(maxsize=4)
def all_profiles() -> tuple[LoaderProfile, ...]:
    """Every loader profile, in their `order`."""
    return tuple(sorted((_read_profile(name, path) for name, path in _profile_files().items()),
                        key=lambda p: (p.order, p.name)))


def loader_names() -> tuple[str, ...]:
    return tuple(p.name for p in all_profiles())


def stock_profile() -> LoaderProfile:
    """Stock exllamav3, the EXL3 format's own engine: the profile of a plan when no engine is named (a library
    caller's default, the exl3 baseline, a pack measured in exllamav3)."""
    return load_profile(EXLLAMAV3)


def load_profile(name: str) -> LoaderProfile:
    """The profile a name from outside (--loader, plan.json, a manifest, a recipe) stands for."""
    for p in all_profiles():
        if p.name == name:
            return p
    raise UserError(f"loader profile {name!r}; choose one of {', '.join(loader_names())}")


def loader_help(what: str) -> str:
    """--loader's help: what it decides in this command, then every profile with its one line."""
    return f"loader profile (docs/loader-profiles.md): {what}. " + "; ".join(
        f"{p.name}: {p.help}" + (f" (default for {', '.join(_default_words(d) for d in p.default_for)})"
                                 if p.default_for else "") for p in all_profiles())


def _default_words(d: DefaultFor) -> str:
    arch = {V4: "V4", "v41": "V4.1"}.get(d.arch, d.arch)
    return arch + (f" on {'/'.join(map(str, d.sparks))} Spark(s)" if d.sparks else "")


def _read_profile(name: str, path: Path) -> LoaderProfile:
    """The profile in `path`, or one UserError line naming the file and what is wrong in it."""
    try:
        return _profile_from(json.loads(path.read_text()), name)
    except (OSError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{path}: not a loader profile ({type(e).__name__}: {e}); docs/loader-profiles.md says what "
                        "one holds") from None


def _profile_from(data: dict, name: str) -> LoaderProfile:
    if data["name"] != name:
        raise ValueError(f"name {data['name']!r} is not the file's name")
    layout = dict(data["layout"])
    if set(layout) != set(GROUPS) or not set(layout.values()) <= {EXL3_FORM, SOURCE_FORM, EITHER, OVERLAY}:
        raise ValueError(f"layout must give exl3|source|either|overlay for {GROUPS}")
    card = data["card"]
    if card["run"] not in RUN_SECTIONS:
        raise ValueError(f"card.run must be one of {RUN_SECTIONS}")
    runbook = tuple(_run_step(s) for s in card.get("runbook", ()))
    return LoaderProfile(
        name=data["name"], engine=data["engine"], archs=tuple(data["archs"]), fit_engine=data["fit_engine"],
        codebooks=tuple(data["codebooks"]), k_min=float(data["k_min"]), k_max=float(data["k_max"]),
        fp16_linears=bool(data["fp16_linears"]), half_rate_codebooks=tuple(data["half_rate_codebooks"]),
        integer_attention=bool(data["integer_attention"]), per_expert_k=bool(data["per_expert_k"]),
        tie_gate_up=bool(data["tie_gate_up"]), aliases=bool(data["aliases"]), layout=layout,
        integer_head=bool(data["integer_head"]),
        default_drafter_bits=None if data["default_drafter_bits"] is None else float(data["default_drafter_bits"]),
        engram_tables=data["engram_tables"], pack_align=int(data["pack_align"]), forbidden_dtypes=tuple(data["forbidden_dtypes"]),
        plain_dtypes=tuple(PlainDtype(r["match"], r["dtype"], tuple(r["accept"])) for r in data["plain_dtypes"]),
        quantization_config=data["quantization_config"],
        config_bits_range=(int(data["config_bits_range"][0]), int(data["config_bits_range"][1])),
        required_config_keys=tuple(data["required_config_keys"]), sources=dict(data["sources"]),
        sparks=tuple(int(n) for n in data["sparks"]), architectures=tuple(data.get("architectures", ())),
        required_files=tuple(data.get("required_files", ())), ignored=dict(data.get("ignored", {})),
        layouts=_layouts(data["expert_layouts"]), decode=_dispatch(data["decode"]),
        help=data["help"], order=int(data["order"]), demo=bool(data["demo"]),
        default_for=tuple(DefaultFor(d["arch"], tuple(d["sparks"]) if "sparks" in d else None) for d in data["default_for"]),
        card=CardInfo(card["library_name"], tuple(card["tags"]), card["run"], runbook),
    )


def _run_step(s: dict) -> RunStep:
    """A runbook step of a profile's card, refused unless its kind, source and placeholders are ones the card knows."""
    step = RunStep(s["step"], s["say"], tuple(s.get("commands", ())), s["source"],
                   tuple(int(n) for n in s.get("sparks", ())), s.get("language", ""))
    if step.step not in RUN_STEPS:
        raise ValueError(f"card.runbook: step must be one of {RUN_STEPS}; got {step.step!r}")
    if not _SOURCE.match(step.source):
        raise ValueError(f"card.runbook: a source names a repository, a path and a commit (owner/name path @commit); "
                         f"got {step.source!r}")
    unknown = set(re.findall(r"\{\{(\w+)\}\}", " ".join([step.say, *step.commands]))) - set(RUN_VALUES)
    if unknown:
        raise ValueError(f"card.runbook: unknown {{{{key}}}} {sorted(unknown)}; known: {RUN_VALUES}")
    return step


def _dispatch(d: dict) -> Dispatch:
    dispatch = Dispatch(int(d["token_launches"]), int(d["layer_launches"]), int(d["fused_launches"]),
                        int(d["mixed_launches"]), int(d["mixed_per_expert"]), bool(d["mixed_is_fused"]), d["graphs"],
                        int(d["draft"]), bool(d["mixed_drafts"]), d["source"])
    if dispatch.graphs not in ("none", "fused", "all"):
        raise ValueError(f"decode: graphs none|fused|all; got {d}")
    return dispatch


def _layouts(d: dict) -> Layouts:
    layouts = Layouts(d["default"], tuple(d["allowed"]), d["fused_tie"], bool(d["half_rates"]), d["source"],
                      int(d.get("groups", 4)), int(d.get("min_group", 4)))
    if not set(layouts.allowed) <= set(EXPERT_LAYOUTS) or layouts.default not in layouts.allowed \
            or layouts.fused_tie not in (GATE_UP, ALL_PROJECTIONS):
        raise ValueError(f"expert_layouts: default and allowed from {EXPERT_LAYOUTS}, fused_tie gate+up|all; got {d}")
    return layouts


def default_profile(cfg: ModelConfig, sparks: int | None = None) -> LoaderProfile:
    """The engine a source of this architecture runs in on `sparks` Sparks, by the profiles' `default_for`, an
    entry for this Spark count before one for any (shipped: exllamav3 for V4; for V4.1 native ExLlamaV3's V4.1
    loader on one Spark, vLLM + vllm-exl3 otherwise)."""
    for specific in (True, False):  # an entry naming the Spark count wins over one for any count
        for p in all_profiles():
            if any(d.matches(cfg.arch, sparks) and (d.sparks is not None) == specific for d in p.default_for):
                return p
    raise UserError(f"no loader profile is the default for {cfg.arch} models; give --loader")


def profiles_for(cfg: ModelConfig, sparks: int | None = None) -> list[LoaderProfile]:
    """The profiles whose engine runs this model's architecture (on `sparks` Sparks, where given), the
    default one first."""
    first = default_profile(cfg, sparks)
    ordered = [first] + [p for p in all_profiles() if p != first]
    return [p for p in ordered if cfg.arch in p.archs and (sparks is None or sparks in p.sparks)]


OLD_ENGINE_NAMES = {"vllm": VLLM_EXL3}  # the hardware file's engine names before they became the profiles' names


def loader_for_engine(engine: str) -> str:
    """The profile the deprecated `--engine` names: an engine of configs/hardware (vllm-exl3, tensorfold, ...,
    or an old name such as vllm) maps to the profile whose `fit_engine` it is; the design floor `native`
    runs no pack, so no profile."""
    engine = OLD_ENGINE_NAMES.get(engine, engine)
    names = loader_names()
    by_engine = {p.fit_engine: p.name for p in all_profiles()}
    if engine in names or engine in by_engine:
        return by_engine.get(engine, engine)
    if engine == "native":
        raise UserError("--engine native: not an engine a pack runs in (DeepSeek's design floor, a lower bound "
                        f"`fit --explain` shows); use --loader {'|'.join(names)}")
    raise UserError(f"--engine {engine}: no such engine; use --loader {'|'.join(names)}")


def check_loader(asked: LoaderProfile | None, named: LoaderProfile, where: str) -> LoaderProfile:
    """`named` (the profile a pack, plan or recipe is made for), or a one-line UserError where --loader
    asks for another: the file's layout decides the engine, not the flag."""
    if asked and asked != named:
        raise UserError(f"--loader {asked.name} conflicts with {where}, which is made for the {named.name} loader profile")
    return named


@dataclass(frozen=True)
class Violation:
    subject: str  # the stored key, or the layer's experts for a grouped rule
    rule: str
    detail: str

    def reason(self, profile: LoaderProfile) -> str:
        return f"{self.detail} (loader {profile.name}, rule {self.rule}: {profile.sources[self.rule]})"

    def line(self, profile: LoaderProfile) -> str:
        return f"{self.subject}: {self.reason(profile)}"


def violations(profile: LoaderProfile, linears: list[StoredLinear], aliases: dict[str, str]) -> list[Violation]:
    """Every rule of `profile` that `linears` (aliased experts left out) and `aliases` break."""
    found: list[Violation] = []
    for s in linears:
        form = profile.layout[s.target.group]
        if form == EXL3_FORM and (s.K is None or s.K == UNQUANTIZED):
            found.append(Violation(s.key, "layout", f"{_show(s.K)} linear of group {s.target.group}, which this "
                                                    "engine reads as EXL3 only"))
            continue
        if form == OVERLAY and s.K == UNQUANTIZED:
            found.append(Violation(s.key, "layout", f"fp16 linear of group {s.target.group}, which this engine reads "
                                                    "as EXL3 or in the source's form"))
            continue
        if form == SOURCE_FORM and s.K is not None:
            found.append(Violation(s.key, "layout", f"{_show(s.K)} linear of group {s.target.group}, which this "
                                                    "engine reads in the source's form only"))
            continue
        if s.K is None or s.K == UNQUANTIZED:
            if s.K == UNQUANTIZED and not profile.fp16_linears:
                found.append(Violation(s.key, "k_range", "fp16 linear (K 16), which this loader does not take"))
            continue
        if s.codebook not in profile.codebooks:
            found.append(Violation(s.key, "codebook", f"codebook {s.codebook}; this loader takes "
                                                      f"{' or '.join(profile.codebooks)}"))
        if not profile.k_min <= s.K <= profile.k_max:
            found.append(Violation(s.key, "k_range", f"K {s.K:g} outside {profile.k_min:g}..{profile.k_max:g}"))
        if s.K != int(s.K):
            if profile.integer_head and s.target.group == HEAD_GROUP:
                found.append(Violation(s.key, "head_bits", f"half-integer head K {s.K:g}; the engine reads an integer"))
            elif profile.integer_attention and s.target.integer_only:
                found.append(Violation(s.key, "integer_attention", f"half-integer K {s.K:g} on a DSV4 attention linear"))
            elif s.codebook not in profile.half_rate_codebooks:
                found.append(Violation(s.key, "half_rates", f"half-integer K {s.K:g} with codebook {s.codebook}"))
    experts = [s for s in linears if s.target.group in (ROUTED, DRAFT) and s.target.expert is not None]
    if not profile.per_expert_k:
        found += _one_k(experts, lambda s: (s.target.group, s.target.layer, s.target.proj), "one_k_per_projection")
    if profile.tie_gate_up:
        gate_up = [s for s in experts if s.target.proj in ("w1", "w3")]
        key = (lambda s: (s.target.group, s.target.layer)) if not profile.per_expert_k else \
            (lambda s: (s.target.group, s.target.layer, s.target.expert))
        found += _one_k(gate_up, key, "gate_up_tied")
    if aliases and not profile.aliases:
        found += [Violation(cold, "aliases", f"aliased to {warm}; this loader reads every expert's own tensors")
                  for cold, warm in sorted(aliases.items())]
    return found


def _one_k(linears: list[StoredLinear], unit, rule: str) -> list[Violation]:
    """One Violation per unit whose linears hold more than one K, naming the first two that differ."""
    first: dict[tuple, StoredLinear] = {}
    bad: dict[tuple, Violation] = {}
    for s in linears:
        u = unit(s)
        f = first.setdefault(u, s)
        if s.K != f.K and u not in bad:
            what = "gate (w1) and up (w3)" if rule == "gate_up_tied" else "experts of one projection"
            bad[u] = Violation(_layer_of(s), rule, f"{what} must share one K: {f.key} has {_show(f.K)}, "
                                                   f"{s.key} has {_show(s.K)}")
    return list(bad.values())


def _layer_of(s: StoredLinear) -> str:
    return s.key.split(".experts.")[0] + ".experts"


def _show(k: float | None) -> str:
    return "source-form" if k is None else "fp16" if k == UNQUANTIZED else f"K {k:g}"
