"""exllamav3's `recipe.yaml` (docs/exl3-format.md, recipes), read into a Plan and written from one.

    loader: vllm-exl3                      # ours: the loader profile the recipe is for
    target_bpw: 2.9
    head_bits: 6
    tensors:                               # exact keys or fnmatch patterns; the LAST match wins
      "layers.*.ffn.experts.*": 3
      layers.5.ffn.experts.*.w2: 2.5
      "layers.*.attn.*": 4

Values: 1..8, 1.5/2.5/3.5 (mul1), 16 = unquantized fp16, and ours: `native` (keep the source
storage). Every budgeted tensor must be covered and every entry must match a tensor. As in
exllamav3 the entries cover the budgeted tensors only and the head takes head_bits (6 when the
recipe gives none); ours also lets an entry whose pattern starts with `mtp.` set the DSpark drafter,
which otherwise stays native, and a recipe without head_bits whose entry matches the key `head`
(`"*": native`, say) gives the head that entry's value: a recipe means what it says. `loader` names the
profile (and so the engine) the plan is for; exllamav3's reader does not read it (docs/exl3-format.md,
recipes). A recipe without one is read for the profile whose rules its K map meets among those that
run the model (on the Spark count, where one is given), the default one first
(contract/rules.matching_profile).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from fnmatch import fnmatchcase
from dataclasses import dataclass
from pathlib import Path

import yaml

from quantizer.checkpoint.config import ModelConfig
from quantizer.contract.loader_profiles import LoaderProfile, default_profile, load_profile, loader_names
from quantizer.contract.plan import Plan
from quantizer.contract.rules import broken_rules, check_plan, for_profile, make_plan, matching_profile
from quantizer.errors import UserError
from quantizer.exl3 import check_k
from quantizer.model.targets import ATTN, DRAFT, ENGRAM, HEAD_GROUP, INDEX, ROUTED, SHARED, Target, targets
from quantizer.shipped import shipped
from quantizer.workdir import read_text, write_text_atomic

NATIVE = "native"
DRAFTER_PREFIX = "mtp."
DEFAULT_HEAD_BITS = 6.0  # exllamav3 -hb default


@dataclass(frozen=True)
class Recipe:
    target_bpw: float | None
    head_bits: float | None  # None: native head
    entries: tuple[tuple[str, float | None], ...]  # (pattern, K or None = native), file order
    path: str = "recipe"
    profile: LoaderProfile | None = None  # the loader profile it names; None: the default for the model and Spark count


def read_recipe(path: str | os.PathLike) -> Recipe:
    """A recipe file, or a shipped one by name (`2.9`, `mia-2.9`: configs/recipes and its published/ maps)."""
    path = _shipped_recipe(Path(path))
    text = read_text(path, f"recipe not found (shipped: {', '.join(shipped_recipes())})")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML{where}; quote keys that start with '*'")
    if not isinstance(data, dict) or not isinstance(data.get("tensors"), dict):
        raise UserError(f"{path}: a recipe needs a `tensors:` mapping of patterns to bits")
    entries = tuple((str(p), _value(v, f"{path}: {p}")) for p, v in data["tensors"].items())
    head = data["head_bits"] if "head_bits" in data else _head_entry(entries)
    bpw = data.get("target_bpw", data.get("achieved_bpw"))
    if bpw is not None and not isinstance(bpw, (int, float)):
        raise UserError(f"{path}: target_bpw {bpw!r} is not a number")
    loader = data.get("loader")
    if loader is not None and loader not in loader_names():
        raise UserError(f"{path}: loader {loader!r}; choose one of {', '.join(loader_names())}")
    return Recipe(None if bpw is None else float(bpw), _value(head, f"{path}: head_bits"), entries, str(path),
                  None if loader is None else load_profile(loader))


def shipped_recipes() -> list[str]:
    """The names of the recipes that ship in configs/recipes (published/: the bit maps of packs people run)."""
    root = shipped("configs", "recipes")
    return sorted(p.stem for p in root.rglob("*.yaml"))


def _shipped_recipe(path: Path) -> Path:
    if path.exists() or path.parent != Path("."):
        return path
    root = shipped("configs", "recipes")
    found = [p for p in root.rglob("*.yaml") if path.name in (p.stem, p.name)]
    return found[0] if len(found) == 1 else path


def _head_entry(entries: tuple[tuple[str, float | None], ...]) -> float | str | None:
    """A recipe without head_bits: the value of the last entry whose pattern matches the key `head`, else
    exllamav3's default."""
    named = [value for pattern, value in entries if fnmatchcase(HEAD_GROUP, pattern)]
    if not named:
        return DEFAULT_HEAD_BITS
    return NATIVE if named[-1] is None else named[-1]


def profile_note(cfg: ModelConfig, recipe: Recipe, plan: Plan, sparks: int | None) -> str:
    """What the output says of a recipe that names no profile: which one it was read for, and why."""
    if recipe.profile:
        return ""
    where = f" on {sparks} Spark{'s' if sparks != 1 else ''}" if sparks else ""
    name = plan.profile.name
    if broken_rules(cfg, plan):
        return f" (names no loader profile and none for {cfg.arch}{where} takes it as it is: read for {name}, the closest)"
    if name == default_profile(cfg, sparks).name:
        return f" (names no loader profile: read for {name}, the default for {cfg.arch}{where})"
    return f" (names no loader profile: read for {name}, whose rules it meets)"


def _value(v, what: str) -> float | None:
    if isinstance(v, str) and v.strip().lower() == NATIVE:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UserError(f"{what}: value {v!r}; use 1..8, 1.5/2.5/3.5, 16 (unquantized) or native")
    return float(v)


def plan_from_recipe(cfg: ModelConfig, recipe: Recipe, codebook: str = "mul1", profile: LoaderProfile | None = None,
                     sparks: int | None = None, keep_rules: bool = True) -> Plan:
    """Apply the recipe to the model's targets: last matching entry wins, as in exllamav3. The plan is for
    `profile`, else the profile the recipe names, else the one whose rules its K map meets among those that
    run the model on `sparks` Sparks (the closest where none does). `keep_rules` False makes a plan that
    may break its profile (what `fit` sizes)."""
    k = _recipe_k(cfg, recipe, codebook)
    made_by = f"recipe {recipe.path}"
    chosen = profile or recipe.profile
    if chosen:
        return make_plan(cfg, k, codebook, chosen, recipe.target_bpw, made_by=made_by, keep_rules=keep_rules)
    plan = make_plan(cfg, k, codebook, default_profile(cfg, sparks), recipe.target_bpw, made_by=made_by,
                     keep_rules=False)
    plan = for_profile(cfg, plan, matching_profile(cfg, plan, sparks)[0])
    if keep_rules:
        check_plan(cfg, plan)
    return plan


def _recipe_k(cfg: ModelConfig, recipe: Recipe, codebook: str) -> dict[str, float | None]:
    """The K map the recipe's entries give every target (UserError for an entry that matches nothing or a
    budgeted target no entry covers)."""
    all_targets = targets(cfg)
    budgeted = [t for t in all_targets if t.budgeted]
    drafter = [t for t in all_targets if t.group == DRAFT]
    k: dict[str, float | None] = {t.key: None for t in all_targets}
    covered: set[str] = set()
    pools = {False: _KeyPool([t.key for t in budgeted]), True: _KeyPool([t.key for t in drafter])}
    for pattern, value in recipe.entries:
        drafter_entry = pattern.startswith(DRAFTER_PREFIX)
        matched = pools[drafter_entry].match(pattern)
        if not matched:
            raise UserError(
                f"{recipe.path}: pattern {pattern!r} matches no {'drafter' if drafter_entry else 'budgeted'} "
                "tensor of this model; fix or remove it (keys look like layers.3.ffn.experts.5.w1)"
            )
        for key in matched:
            k[key] = value
        covered.update(matched)
    uncovered = [t.key for t in budgeted if t.key not in covered]
    if uncovered:
        raise UserError(
            f"{recipe.path}: {len(uncovered)} budgeted tensor(s) match no entry, e.g. {uncovered[0]}; "
            "add a pattern for them (or `native`)"
        )
    for t in all_targets:
        if t.group == HEAD_GROUP:
            k[t.key] = recipe.head_bits
    by_key = {t.key: t for t in all_targets}
    for key, value in k.items():
        if value is not None:
            check_k(value, codebook, by_key[key].integer_only, f"{recipe.path}: {key}")
    return k


class _KeyPool:
    """Keys matched by fnmatch patterns in one regex scan over all keys (47k keys, ~100 patterns)."""

    def __init__(self, keys: list[str]):
        self.keys = set(keys)
        self.text = "\n".join(keys)

    def match(self, pattern: str) -> list[str]:
        if not any(c in pattern for c in "*?["):
            return [pattern] if pattern in self.keys else []
        rx = re.compile(f"^{_glob_regex(pattern)}$", re.MULTILINE)
        return [m.group(0) for m in rx.finditer(self.text) if m.group(0)]


def _glob_regex(pattern: str) -> str:
    """fnmatch semantics (`*`, `?`, `[seq]`, `[!seq]`) as a regex that never crosses a newline."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        i += 1
        if c == "*":
            out.append(r"[^\n]*")
        elif c == "?":
            out.append(r"[^\n]")
        elif c == "[":
            j = i + (1 if pattern[i:i + 1] == "!" else 0)
            j = pattern.find("]", j + 1)
            if j < 0:
                out.append(re.escape(c))
                continue
            body = pattern[i:j]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append(f"(?=[^\\n])[{body.replace(chr(92), chr(92) * 2)}]")
            i = j + 1
        else:
            out.append(re.escape(c))
    return "".join(out)


# ---- writing ----------------------------------------------------------------------------------

_MISSING = object()
_GROUP_ORDER = (ROUTED, SHARED, ATTN, INDEX, ENGRAM, DRAFT)  # the indexer must follow attention


def recipe_entries(cfg: ModelConfig, plan: Plan) -> list[tuple[str, float | None]]:
    """Few entries that reproduce the plan: a default per group, then layer, projection and key
    overrides wherever they change more tensors to their K than they would leave."""
    entries: list[tuple[str, float | None]] = []
    by_group: dict[str, list[Target]] = {}
    for t in targets(cfg):
        by_group.setdefault(t.group, []).append(t)
    for group in _GROUP_ORDER:
        members = by_group.get(group, [])
        # budgeted groups start uncovered; the drafter starts native (its default)
        current = {t.key: (None if group == DRAFT else _MISSING) for t in members}
        for level in _levels(group):
            buckets: dict[str, list[Target]] = {}
            for t in members:
                buckets.setdefault(level(t), []).append(t)
            for pattern, ts in buckets.items():
                want = Counter(plan.k[t.key] for t in ts)
                value, hits = want.most_common(1)[0]
                keep = sum(1 for t in ts if current[t.key] is not _MISSING and current[t.key] == plan.k[t.key])
                if hits > keep:
                    entries.append((pattern, value))
                    for t in ts:
                        current[t.key] = value
    return entries


def _levels(group: str):
    stem = {
        ROUTED: ".ffn.experts.", SHARED: ".ffn.shared_experts.", ATTN: ".attn.",
        INDEX: ".attn.indexer.", ENGRAM: ".engram.",
    }.get(group)
    if group == DRAFT:
        return (
            lambda t: "mtp.*",
            lambda t: f"mtp.{t.layer}.*",
            lambda t: f"mtp.{t.layer}.ffn.experts.*.{t.proj}" if t.expert is not None else t.key,
            lambda t: t.key,
        )
    levels = [lambda t: f"layers.*{stem}*", lambda t: f"layers.{t.layer}{stem}*"]
    if group == ROUTED:
        levels.append(lambda t: f"layers.{t.layer}{stem}*.{t.proj}")
    levels.append(lambda t: t.key)
    return tuple(levels)


def write_recipe(cfg: ModelConfig, plan: Plan, path: str | os.PathLike, header: str = "") -> Path:
    """Write the plan as an exllamav3 recipe (atomically); `header` becomes leading comment lines."""
    path = Path(path)
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines.append(f"loader: {plan.profile.name}")
    if plan.target_bpw is not None:
        lines.append(f"target_bpw: {plan.target_bpw:g}")
    lines.append(f"head_bits: {_yaml_value(plan.head_bits)}")
    lines.append("tensors:")
    for pattern, value in recipe_entries(cfg, plan):
        lines.append(f"  {_yaml_key(pattern)}: {_yaml_value(value)}")
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def _yaml_key(pattern: str) -> str:
    return f'"{pattern}"' if any(c in pattern for c in "*?[]!") else pattern


def _yaml_value(k: float | None) -> str:
    if k is None:
        return NATIVE
    return str(int(k)) if k == int(k) else f"{k:g}"

