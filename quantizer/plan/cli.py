"""`quantizer plan SRC|--model-config C --bpw B [--out plan.json] [--recipe-out recipe.yaml]`.

Only the uniform plan for now; the allocator extends this command.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from quantizer.errors import UserError
from quantizer.model.config import ModelConfig
from quantizer.plan.plan import TOTAL, TOTAL_RESIDENT, Plan
from quantizer.plan.recipe import write_recipe
from quantizer.plan.sizes import CODEBOOKS
from quantizer.plan.targets import GROUPS, ROUTED, targets
from quantizer.plan.uniform import uniform_plan
from quantizer.report import gib, table
from quantizer.shipped import model_config_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose K for every EXL3 tensor (uniform plan at a target bpw)")
    add_model_arguments(p)
    p.add_argument("--bpw", type=float, required=True, help="target bits per weight over the budgeted tensors")
    add_plan_arguments(p)
    p.add_argument("--out", type=Path, help="write the plan as JSON")
    p.add_argument("--recipe-out", type=Path, help="write the plan as an exllamav3 recipe.yaml")
    p.set_defaults(func=run)


SRC_HELP = "native checkpoint directory (its config.json is read)"


def add_model_arguments(p: argparse.ArgumentParser, src_help: str = SRC_HELP) -> None:
    p.add_argument("src", nargs="?", help=src_help)
    p.add_argument("--model-config", help="a config.json, or a shipped shape such as deepseek-v4.1-flash")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codebook", choices=CODEBOOKS, default="mul1")
    p.add_argument("--head-bits", type=_bits, default=6.0, help="K of the LM head (or native)")
    p.add_argument("--drafter-bits", type=_bits, default=None, help="K of the DSpark drafter (default native)")


def _bits(text: str) -> float | None:
    if text.lower() == "native":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a K such as 4 or 2.5, or native")


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


def run(args: argparse.Namespace) -> int:
    cfg = load_model_config(args.src, args.model_config)
    plan = uniform_plan(cfg, args.bpw, args.codebook, args.head_bits, args.drafter_bits)
    print(render(cfg, plan))
    if args.out:
        plan.save(args.out)
        print(f"wrote {args.out}")
    if args.recipe_out:
        write_recipe(cfg, plan, args.recipe_out, recipe_header(args, plan))
        print(f"wrote {args.recipe_out}")
    return 0


def recipe_header(args: argparse.Namespace, plan: Plan) -> str:
    model = args.model_config or "<checkpoint>/config.json"
    extra = "" if args.codebook == "mul1" else f" --codebook {args.codebook}"
    return "\n".join([
        f"exllamav3 recipe for {model} at {args.bpw:g} bpw, stock mode (one K per projection per layer).",
        f"Made by {plan.made_by}.",
        f"Regenerate: quantizer plan --model-config {model} --bpw {args.bpw:g}{extra} --recipe-out <this file>",
        f"Achieved bits (exllamav3 accounting, budgeted tensors): {plan.achieved_bpw:.4f}; "
        f"expected pack {gib(plan.expected_bytes[TOTAL_RESIDENT])} GiB without the Engram tables.",
        "Values: 1..8, 1.5/2.5/3.5 (mul1), 16 = fp16; `native` (ours) keeps the source storage.",
        "The DSpark drafter (mtp.*) is not listed, so it stays native.",
    ])


def render(cfg: ModelConfig, plan: Plan) -> str:
    """K per group (routed experts per layer), bpw, and expected bytes per class."""
    by_group: dict[str, Counter] = {g: Counter() for g in GROUPS}
    layers: dict[int, float | None] = {}
    for t in targets(cfg):
        k = plan.k[t.key]
        by_group[t.group][_k(k)] += 1
        if t.group == ROUTED:
            layers.setdefault(t.layer, k)
    rows = [[g, ", ".join(f"{k} x{n:,}" for k, n in sorted(c.items()))] for g, c in by_group.items() if c]
    runs = _runs(layers)
    sizes = plan.expected_bytes
    lines = [
        f"{plan.made_by}: achieved {plan.achieved_bpw:.4f} bits over budgeted tensors "
        f"(target {plan.target_bpw:g}); mode {plan.mode}, codebook {plan.codebook}; hash {plan.content_hash()[:16]}",
        table(["group", "K (count)"], rows, right=set()),
        "routed experts by layer: " + "; ".join(runs),
        "",
        table(["class", "GiB"], [[c, gib(n)] for c, n in sizes.items() if c not in (TOTAL, TOTAL_RESIDENT)]
              + [["total", gib(sizes[TOTAL])], ["without Engram tables", gib(sizes[TOTAL_RESIDENT])]]),
    ]
    return "\n".join(lines)


def _k(k: float | None) -> str:
    return "native" if k is None else f"{k:g}"


def _runs(layers: dict[int, float | None]) -> list[str]:
    """`L0-14 K3; L15-24 K2.5; ...` from a layer -> K map."""
    out, start = [], None
    order = sorted(layers)
    for i, layer in enumerate(order):
        if start is None:
            start = layer
        last = i + 1 == len(order) or layers[order[i + 1]] != layers[layer]
        if last:
            span = f"L{start}" if start == layer else f"L{start}-{layer}"
            out.append(f"{span} K{_k(layers[layer])}")
            start = None
    return out
