"""Whether the routed experts should be calibrated on the quantized model's own inputs: a pack's routed
experts re-encoded three ways, layer after layer, and measured in our forward (CPU, small models).

Issue 20 (item 3) asks for expert calibration "as the experts are used". `build` calibrates every
Hessian on the native model's inputs, in one pass before anything is quantized. Two published
alternatives use the inputs the quantized model produces instead:

- `sequential` (GPTQ's order): layer by layer, each layer's expert Hessians are taken on the inputs of
  the model whose earlier layers are already re-encoded, so an expert is encoded for the inputs it will
  see; its target stays the native weight W.
- `asymmetric` (GPTAQ, Li et al., arXiv 2504.02692): the same inputs X_q, and the target is what maps
  them to the native outputs: minimising ||X_q A^T - X W^T||^2 over A gives A = W C H_q^-1 with
  C = X^T X_q and H_q = X_q^T X_q (each weighted per token as below), so encoding A under H_q also
  undoes what the layers before got wrong. --damp adds damp x mean(diag H_q) to C and H_q, pulling A
  towards W (damp large: A = W, the `sequential` variant).
- `native` is the control: the same encoder, rows, seed and weighting on the native inputs, what
  `build --expert-hessians shared` does. The pack's own KL is printed too, but its encoding saw other rows, so only the three
  variants are compared with each other.

Every variant keeps each expert linear's K from the pack and encodes with our CPU codec; the weighting
is `--expert-hessians shared` (`build`'s default until 2026-12-03, docs/calibration.md): gate and up projections on every
token of the layer, the down projection on its routed tokens weighted by the squared gate plus the
all-token prior of 512 tokens. Everything that is not a routed expert stays as the pack holds it. The
model is held whole in memory (DeepseekModel), so this is for the bundled small models.

    python bench/asymmetric_experts.py PACK [--source DIR] [--variants native,sequential,asymmetric]
        [--calib-rows 16] [--damp 0.01] [--seed 0] [--eval-text SET ...] [--eval-rows 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing_bound import fit_linear  # noqa: E402

from quantizer.calibrate.settings import CalibrationSettings  # noqa: E402
from quantizer.checkpoint.source import Checkpoint  # noqa: E402
from quantizer.codec import dequantize  # noqa: E402
from quantizer.codec.linear import quantize_linear  # noqa: E402
from quantizer.errors import UserError  # noqa: E402
from quantizer.model.hooks import ForwardHooks, RoutingEvent  # noqa: E402
from quantizer.model.targets import targets  # noqa: E402
from quantizer.model.transformer import DeepseekModel  # noqa: E402
from quantizer.pack.manifest import Manifest  # noqa: E402
from quantizer.ppl.compare import compare  # noqa: E402
from quantizer.ppl.exllamav3_engine import predictions, stored_k  # noqa: E402
from quantizer.ppl.pack_source import PackSource  # noqa: E402
from quantizer.quantize.linears import tensor_seed  # noqa: E402
from quantizer.shipped import shipped  # noqa: E402
from quantizer.textdata import model_rows, text_argument  # noqa: E402

VARIANTS = ("native", "sequential", "asymmetric")
PRIOR_TOKENS = CalibrationSettings().prior_tokens


class Overrides:
    """Replacement weights by native name (`layers.3.ffn.experts.5.w1.weight`), as forward hooks."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = dict(weights)

    def hooks(self, **more) -> ForwardHooks:
        return ForwardHooks(weight_override=lambda name, w: self.weights.get(name), **more)


def logits(model: DeepseekModel, rows: torch.Tensor, hooks: ForwardHooks) -> torch.Tensor:
    return torch.cat([model(rows[i:i + 1], hooks) for i in range(len(rows))])


def expert_inputs(model: DeepseekModel, rows: torch.Tensor, over: Overrides, layer: int
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every routed expert linear's input of `layer` on every token ([tokens, in], all experts run on
    all tokens), and the layer's routing: expert ids and gate weights [tokens, k]."""
    prefix, inputs, routing = f"layers.{layer}.ffn.experts.", {}, []

    def take(name: str, x: torch.Tensor) -> None:
        if name.startswith(prefix):
            inputs.setdefault(name, []).append(x.reshape(-1, x.shape[-1]))

    def route(event: RoutingEvent) -> None:
        if event.layer == f"layers.{layer}":
            routing.append((event.expert_ids, event.weights))

    hooks = over.hooks(linear_input=take, routing=route, all_experts=True)
    for i in range(len(rows)):
        model(rows[i:i + 1], hooks)
    ids = torch.cat([r[0] for r in routing])
    gates = torch.cat([r[1] for r in routing])
    return {k: torch.cat(v) for k, v in inputs.items()}, ids, gates


def token_weights(proj: str, expert: int, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Per-token weight of one expert linear's H (`shared`): 1 for gate/up; for down, the squared gate
    where the token is routed here plus the all-token prior of PRIOR_TOKENS mean squared gates."""
    if proj != "w2":
        return torch.ones(ids.shape[0])
    routed = ((ids == expert) * gates ** 2).sum(-1)
    return routed + PRIOR_TOKENS * float((gates ** 2).mean()) / ids.shape[0]


def asymmetric_target(w: torch.Tensor, x: torch.Tensor, xq: torch.Tensor, omega: torch.Tensor, damp: float
                      ) -> torch.Tensor:
    """The weight that best maps the quantized inputs xq to the native outputs x W^T, each token weighted by
    omega: W (C + l I)(H_q + l I)^-1 with l = damp x mean(diag H_q)."""
    root = omega.sqrt()[:, None]
    return fit_linear(xq * root, (x * root) @ w.T, w, ridge=damp)


def reencode(variant: str, model: DeepseekModel, native: dict[str, torch.Tensor], pack: Overrides,
             kmap: dict, codebook: str, rows: torch.Tensor, damp: float, seed: int) -> Overrides:
    """The pack with its routed experts re-encoded by `variant`, layer after layer."""
    over = Overrides(pack.weights)
    cfg = model.cfg
    for layer in range(cfg.num_layers):
        start = time.monotonic()
        x, ids_n, gates_n = expert_inputs(model, rows, Overrides({}), layer)
        xq, ids, gates = (x, ids_n, gates_n) if variant == "native" else expert_inputs(model, rows, over, layer)
        for e in range(cfg.n_routed_experts):
            for proj in ("w1", "w2", "w3"):
                key = f"layers.{layer}.ffn.experts.{e}.{proj}"
                name = key + ".weight"
                if not kmap.get(key):
                    continue
                omega = token_weights(proj, e, ids, gates)
                h = (xq[name] * omega[:, None]).T @ xq[name]
                w = native[name]
                if variant == "asymmetric":
                    w = asymmetric_target(w, x[name], xq[name], omega, damp)
                q = quantize_linear(w, kmap[key], h, max(1, round(float(omega.sum()))), codebook=codebook,
                                    seed=tensor_seed(seed, key))
                over.weights[name] = dequantize(q)
        print(f"{variant}: layer {layer} re-encoded in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return over


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pack", type=Path)
    ap.add_argument("--source", type=Path, default=None,
                    help="the pack's native checkpoint (default the bundled small V4.1 model)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--calib-rows", type=int, default=16, help="rows of 2048 tokens of the shipped calibration text")
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0, help="the encoder's job seed")
    ap.add_argument("--eval-text", nargs="+", default=["heldout", "heldout-tests"])
    ap.add_argument("--eval-rows", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    if args.damp < 0:
        ap.error(f"--damp {args.damp}: must be 0 or more (it pulls the asymmetric target towards the native weight)")
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    try:
        run(args, variants)
    except UserError as e:
        print(f"asymmetric_experts: {e}", file=sys.stderr)
        sys.exit(2)


def run(args, variants: list[str]) -> None:
    torch.set_grad_enabled(False)
    ck = Checkpoint.open(args.source or shipped("small_model"))
    cfg = ck.config
    packed = Checkpoint.open(args.pack)
    kmap = stored_k(args.pack, cfg)
    codebook = Manifest.load(args.pack).plan["codebook"]
    source = PackSource(packed)
    pack = Overrides({t.key + ".weight": source.weight(t.key + ".weight", torch.float32, "cpu")
                      for t in targets(cfg) if kmap.get(t.key)})
    model = DeepseekModel.from_checkpoint(ck, torch.float32, "cpu")
    native = {name: p.detach().clone() for name, p in model.named_parameters()}
    calib = model_rows(ck.root, cfg, text=text_argument("calibration"), rows=args.calib_rows, cols=2048, default_cols=2048)
    evals = {t: model_rows(ck.root, cfg, text=text_argument(t), rows=args.eval_rows, cols=512, default_cols=512)
             for t in args.eval_text}
    reference = {t: predictions(logits(model, r, ForwardHooks()), r) for t, r in evals.items()}
    out = open(args.json, "w") if args.json else None

    def report(name: str, over: Overrides) -> None:
        for t, r in evals.items():
            c = compare(reference[t], predictions(logits(model, r, over.hooks()), r))
            row = {"variant": name, "text": t, "kl": c.kl, "kl_stderr": c.kl_stderr, "top1": c.top1,
                   "ppl": c.pack.ppl, "calib_rows": args.calib_rows, "damp": args.damp, "seed": args.seed}
            print(f"{name:10s} {t:14s} KL {c.kl:.4f} +- {c.kl_stderr:.4f}  top-1 {c.top1:.2%}  ppl {c.pack.ppl:.3f}",
                  flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()

    report("pack", pack)
    for v in variants:
        report(v, reencode(v, model, native, pack, kmap, codebook, calib, args.damp, args.seed))


if __name__ == "__main__":
    main()
