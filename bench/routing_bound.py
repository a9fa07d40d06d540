"""How much of a pack's KL comes from routing: the pack run with the native model's expert choices.

Issue 20 asks whether refitting the router bias (so that the quantized model picks the native model's
top-k) is worth building. No refit can do better than routing every token exactly as the native model
does, so this bench measures that bound in our forward (CPU): for each pack, KL against the native model
on held-out rows as the pack runs, and again with every routed layer's experts forced to the native
model's choice for the same token (`ForwardHooks.expert_override`, weighted by the pack's own router
scores as its choice would be). It also prints how often the pack's router already agrees with the
native one (the same top-k set), per routed layer, and how nearly tied the native routers are: the median
gap between the k-th and (k+1)-th experts' selection scores over the chosen ones' mean score (the smaller,
the smaller an input error that swaps an expert). Hash layers take their experts from a table and agree
by construction; they are left out of both.

With --refit-rows N it also tries a refit, on N rows of the calibration text (disjoint from the held-out
sets), then measures the held-out KL of the pack with the refitted routers. `--refit bias` (default): for
each routed layer, a new selection bias fitted so that the pack's router scores plus the bias rank the
native model's experts first (a hinge on the gap between the lowest native expert and the highest other
one, Adam), layer after layer in --refit-rounds passes (each pass routes the calibration rows with the
biases fitted so far). `--refit weight`: each routed layer's router weight (hidden x experts values, not
one per expert) refitted in closed form, layer after layer, so that on the pack's own router inputs (the
layers before already refitted) it gives the native router's logits on the native inputs of the same
tokens (ridge least squares, pulled towards the native weight; rounded to the pack's dtype).

    python bench/routing_bound.py PACK [PACK ...] [--source DIR] [--eval-text SET ...] [--eval-rows 8]
                                  [--cols 512] [--refit-rows 16 [--refit bias|weight] [--refit-rounds 2]]
                                  [--json OUT]

PACK: packs of the source model (default the bundled small V4.1 model), for example the demo's packs
(`quantizer demo --work W` keeps them under W/packs). The reference is the pack as it runs, measured in
the same process on the same rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from quantizer.checkpoint.source import Checkpoint
from quantizer.errors import UserError
from quantizer.model.hooks import ForwardHooks
from quantizer.model.streaming import CheckpointSource, LayerStreamer
from quantizer.ppl.compare import compare
from quantizer.ppl.pack_source import PackSource
from quantizer.ppl.perplexity import row_predictions
from quantizer.shipped import shipped
from quantizer.textdata import model_rows, text_argument


class Choices:
    """Expert ids per routed layer and forward chunk, in the order the forward asks for them."""

    def __init__(self, hashed: set[str]):
        self.hashed = hashed
        self.ids: dict[tuple[str, int], torch.Tensor] = {}
        self._calls: dict[str, int] = defaultdict(int)

    def key(self, layer: str) -> tuple[str, int]:
        n = self._calls[layer]
        self._calls[layer] += 1
        return layer, n

    def record(self, layer: str, ids: torch.Tensor) -> None:
        self.ids[self.key(layer)] = ids.clone()


class WithRouters:
    """A weight source whose routers' tensors are replaced (`layers.L.ffn.gate.bias` or `.weight` -> tensor)."""

    def __init__(self, source, replaced: dict[str, torch.Tensor]):
        self.source, self.config, self.replaced = source, source.config, replaced

    def weight(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        if name in self.replaced:
            return self.replaced[name].to(device=device, dtype=dtype)
        return self.source.weight(name, dtype, device)

    def __getattr__(self, name):
        return getattr(self.source, name)


def fit_bias(scores: torch.Tensor, native_ids: torch.Tensor, bias: torch.Tensor, steps: int = 300) -> torch.Tensor:
    """A selection bias under which scores [N, E] rank the native experts [N, k] first on as many tokens as
    it can: Adam on the mean hinge max(other) - min(native) + margin, keeping the best step's agreement."""
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, native_ids, True)
    margin = 0.01 * float(scores.abs().mean())
    delta = torch.zeros_like(bias, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=margin)

    def agreement(b: torch.Tensor) -> float:
        picked = (scores + b).topk(native_ids.shape[1], dim=-1).indices
        return float(torch.zeros_like(chosen).scatter_(1, picked, True).eq(chosen).all(-1).float().mean())

    best, best_bias = agreement(bias), bias.clone()
    for _ in range(steps):
        s = scores + bias + delta
        gap = s.masked_fill(chosen, float("-inf")).amax(-1) - s.masked_fill(~chosen, float("inf")).amin(-1)
        loss = torch.relu(gap + margin).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            a = agreement(bias + delta)
            if a > best:
                best, best_bias = a, (bias + delta).detach().clone()
    return best_bias


def refit_biases(pack: Path, rows: torch.Tensor, native: Choices, rounds: int) -> dict[str, torch.Tensor]:
    """Selection biases for the pack's routed layers, fitted on `rows` to the native choices `native`."""
    ck = Checkpoint.open(pack)
    biases = {f"{layer}.ffn.gate.bias": ck.raw(f"{layer}.ffn.gate.bias").float()
              for layer, _ in native.ids if layer not in native.hashed}
    for _ in range(rounds):
        seen: dict[str, list[torch.Tensor]] = defaultdict(list)
        _predictions(WithRouters(PackSource(ck), biases), rows,
                     ForwardHooks(routing=lambda e: seen[e.layer].append(e.scores.detach())))
        for name in biases:
            layer = name.rsplit(".ffn.", 1)[0]
            target = torch.cat([native.ids[layer, n] for n in range(len(seen[layer]))])
            biases[name] = fit_bias(torch.cat(seen[layer]), target, biases[name])
    return biases


def fit_linear(x: torch.Tensor, target: torch.Tensor, native: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """The weight [out, in] whose outputs on inputs x [N, in] are closest to `target` [N, out] in least
    squares, with a ridge of `ridge` times the inputs' mean energy per feature pulling it towards `native`
    (here a router's weight; bench/asymmetric_experts.py fits experts' weights with it)."""
    gram = x.T @ x
    reg = ridge * gram.diagonal().mean()
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + reg * eye, x.T @ target + reg * native.T).T.contiguous()


def _router_inputs(source, rows: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """Each named router weight's inputs [tokens, D] (float32) as `source` runs `rows`."""
    seen: dict[str, list[torch.Tensor]] = defaultdict(list)

    def hook(name: str, x: torch.Tensor) -> None:
        if name in names:
            seen[name].append(x.reshape(-1, x.shape[-1]).float())

    _predictions(source, rows, ForwardHooks(linear_input=hook))
    return {name: torch.cat(seen[name]) for name in names}


def refit_weights(pack: Path, native_ck: Checkpoint, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Router weights for the pack's routed layers, in order: each fitted (fit_linear) on the pack's
    inputs to that router, the layers before already refitted, to the native logits on `rows`."""
    ck = Checkpoint.open(pack)
    hashed = _hashed_layers(native_ck)
    names = sorted((n for n in native_ck.tensors if n.endswith(".ffn.gate.weight")
                    and n.rsplit(".ffn.", 1)[0] not in hashed and n.startswith("layers.")),
                   key=lambda n: int(n.split(".")[1]))
    native_inputs = _router_inputs(CheckpointSource(native_ck), rows, names)
    weights: dict[str, torch.Tensor] = {}
    for name in names:
        x = _router_inputs(WithRouters(PackSource(ck), weights), rows, [name])[name]
        native = native_ck.raw(name).float()
        weights[name] = fit_linear(x, native_inputs[name] @ native.T, native).to(ck.raw(name).dtype)
    return weights


def _hashed_layers(ck: Checkpoint) -> set[str]:
    return {name.rsplit(".ffn.", 1)[0] for name in ck.tensors if name.endswith(".ffn.gate.tid2eid")}


def _predictions(source, rows: torch.Tensor, hooks: ForwardHooks | None = None) -> list:
    return list(row_predictions(LayerStreamer(source, hooks=hooks, progress=False, report=lambda line: None), rows))


def measure(pack: Path, rows: torch.Tensor, native_preds: list, native: Choices,
            routers: dict[str, torch.Tensor] | None = None) -> dict:
    source = PackSource(Checkpoint.open(pack))
    if routers is not None:
        source = WithRouters(source, routers)
    own = Choices(native.hashed)

    def record(layer, ids):
        own.record(layer, ids)
        return None

    as_is = compare(native_preds, _predictions(source, rows, ForwardHooks(expert_override=record)))
    replay = Choices(native.hashed)

    def force(layer, ids):
        return native.ids[replay.key(layer)]

    forced = compare(native_preds, _predictions(source, rows, ForwardHooks(expert_override=force)))
    agree: dict[str, list[float]] = defaultdict(list)
    for (layer, n), ids in own.ids.items():
        if layer in native.hashed:
            continue
        mine, theirs = ids.sort(-1).values, native.ids[layer, n].sort(-1).values
        agree[layer].append(float((mine == theirs).all(-1).float().mean()))
    per_layer = {layer: sum(v) / len(v) for layer, v in agree.items()}
    return {"pack": str(pack), "kl": as_is.kl, "kl_stderr": as_is.kl_stderr, "top1": as_is.top1, "ppl": as_is.pack.ppl,
            "kl_native_routing": forced.kl, "kl_native_routing_stderr": forced.kl_stderr,
            "top1_native_routing": forced.top1, "ppl_native_routing": forced.pack.ppl,
            "kl_ratio": forced.kl / as_is.kl, "same_topk": per_layer,
            "same_topk_mean": sum(per_layer.values()) / max(1, len(per_layer))}


def selection_margin(selection: torch.Tensor, k: int) -> torch.Tensor:
    """Per token of selection scores [N, E] (scores plus the selection bias): the gap between the k-th and
    the (k+1)-th expert over the mean of the k chosen, the relative move of the scores that swaps an expert."""
    top = selection.topk(k + 1, dim=-1).values
    return (top[:, k - 1] - top[:, k]) / top[:, :k].mean(-1)


def _native(ck: Checkpoint, rows: torch.Tensor) -> tuple[list, Choices, dict[str, torch.Tensor]]:
    """The native model's predictions on `rows`, its expert choices, and per routed layer every token's
    selection margin (how nearly tied its k-th and (k+1)-th experts are)."""
    native = Choices(_hashed_layers(ck))
    margins: dict[str, list[torch.Tensor]] = defaultdict(list)

    def record(layer, ids):
        native.record(layer, ids)
        return None

    def routed(event):
        if event.layer not in native.hashed:
            bias = ck.raw(f"{event.layer}.ffn.gate.bias").float()
            margins[event.layer].append(selection_margin(event.scores + bias, ck.config.experts_per_token))

    preds = _predictions(CheckpointSource(ck), rows, ForwardHooks(expert_override=record, routing=routed))
    return preds, native, {layer: torch.cat(m) for layer, m in margins.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packs", nargs="+", type=Path)
    ap.add_argument("--source", type=Path, help="the packs' native model (default the bundled small V4.1 model)")
    ap.add_argument("--eval-text", nargs="+", default=["heldout"], help="shipped sets or files (default heldout)")
    ap.add_argument("--eval-rows", type=int, default=8)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--refit-rows", type=int, default=0, help="calibration rows to refit the routers on")
    ap.add_argument("--refit", choices=("bias", "weight"), default="bias",
                    help="what of each routed layer's router is refitted (default %(default)s)")
    ap.add_argument("--refit-rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    native_ck = Checkpoint.open(args.source or shipped("small_model"))
    refits = {}
    if args.refit_rows:
        rows = model_rows(native_ck.root, native_ck.config, text=text_argument("calibration"), rows=args.refit_rows,
                          cols=args.cols, default_cols=args.cols)
        if args.refit == "bias":
            native = _native(native_ck, rows)[1]
            refits = {pack: refit_biases(pack, rows, native, args.refit_rounds) for pack in args.packs}
        else:
            refits = {pack: refit_weights(pack, native_ck, rows) for pack in args.packs}
    results = []
    for name in args.eval_text:
        rows = model_rows(native_ck.root, native_ck.config, text=text_argument(name), rows=args.eval_rows,
                          cols=args.cols, default_cols=args.cols)
        native_preds, native, margins = _native(native_ck, rows)
        medians = {layer: float(m.median()) for layer, m in margins.items()}
        print(f"{name:14s} native routers: the k-th and (k+1)-th experts' selection scores differ by a median "
              f"{', '.join(f'{v:.1%}' for v in medians.values())} of the chosen ones' mean (per routed layer)",
              flush=True)
        for pack in args.packs:
            row = {"eval_text": name, **measure(pack, rows, native_preds, native), "native_margin_median": medians}
            if pack in refits:
                refit = measure(pack, rows, native_preds, native, refits[pack])
                row |= {"refit": args.refit, "kl_refit": refit["kl"], "kl_refit_stderr": refit["kl_stderr"],
                        "top1_refit": refit["top1"], "ppl_refit": refit["ppl"], "same_topk_refit": refit["same_topk"],
                        "same_topk_refit_mean": refit["same_topk_mean"]}
            results.append(row)
            print(f"{name:14s} {pack.name:28s} KL {row['kl']:.4f} ± {row['kl_stderr']:.4f} -> with the native "
                  f"routing {row['kl_native_routing']:.4f} ± {row['kl_native_routing_stderr']:.4f} "
                  f"({row['kl_ratio']:.3f}x); top-1 {row['top1']:.4f} -> {row['top1_native_routing']:.4f}; "
                  f"same top-k as native on {row['same_topk_mean']:.1%} of routed tokens "
                  f"(per layer {', '.join(f'{v:.2f}' for v in row['same_topk'].values())})", flush=True)
            if pack in refits:
                print(f"{'':14s} {'':28s} router {args.refit} refitted: KL {row['kl_refit']:.4f} ± "
                      f"{row['kl_refit_stderr']:.4f} ({row['kl_refit'] / row['kl']:.3f}x), top-1 {row['top1_refit']:.4f}, "
                      f"same top-k {row['same_topk_refit_mean']:.1%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except UserError as e:  # a missing pack, an unknown text: one line, exit 2, nothing written
        print(f"routing_bound: {e}", file=sys.stderr)
        raise SystemExit(2) from None
