"""Train a small model that ships with quantizer (V4.1 or V4 architecture), and export it natively.

    python training/train_small.py tokens --cache DIR                         # here: tokenize train/heldout (needs zstandard)
    python training/train_small.py train --cache DIR --config CFG --out DIR   # on a GPU: train, then export

CFG is configs/models/small-v41.json (the default: every V4.1 component, mHC, compressed attention
with Full/Reuse/Reindex layers, Engram, MoE with a shared expert, one DSpark block) or
configs/models/small-v4.json (V4: hash-routed layers, sliding/CSA/HCA attention, three DSpark
blocks) or configs/models/small-v4-moe64.json (the V4 testbed: 64 experts routed top-6, no drafter).
The drafter has no forward here, so its blocks keep random initial weights. Training reads
calibration/train.jsonl.zst through the 4096-token BPE tokenizer; the export is what DeepSeek ships
for the architecture: FP8 e4m3 with E8M0 block grids (the config's weight_block_size), MXFP4 routed
experts, BF16/F32/I64 elsewhere. OUT becomes the model directory (config, shards, tokenizer.json)
plus training.json, which records the held-out NLL of the trained weights rounded to bf16 and of
the exported checkpoint, both computed in float32.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from quantizer.checkpoint.config import ModelConfig  # noqa: E402
from quantizer.model.hooks import ForwardHooks, RoutingEvent  # noqa: E402
from quantizer.model.layout import TensorSpec  # noqa: E402
from quantizer.model.transformer import DeepseekModel, init_parameters  # noqa: E402
from quantizer.tiny.native_writer import write_native_checkpoint  # noqa: E402

CONFIG = REPO / "configs" / "models" / "small-v41.json"
TOKENIZER = REPO / "calibration" / "tokenizer.json"
EOS = 1


def tokenize(cache: Path) -> None:
    """Token streams for the train and held-out sets, with eos between documents, as uint16 .npy."""
    from quantizer.textdata import default_text, encode_texts, load_tokenizer

    tok = load_tokenizer(TOKENIZER)
    cache.mkdir(parents=True, exist_ok=True)
    for name in ("train", "heldout"):
        ids = encode_texts(tok, default_text(name), eos=EOS)
        np.save(cache / f"{name}.npy", ids.numpy().astype(np.uint16))
        print(f"{name}: {ids.numel():,} tokens")


def batches(stream: torch.Tensor, rows: int, cols: int, gen: torch.Generator):
    """Random windows of the token stream: (inputs, targets), each [rows, cols]."""
    while True:
        start = torch.randint(0, stream.numel() - cols - 1, (rows,), generator=gen)
        idx = start[:, None] + torch.arange(cols + 1)
        window = stream[idx]
        yield window[:, :-1], window[:, 1:]


@torch.no_grad()
def evaluate(model: DeepseekModel, stream: torch.Tensor, cols: int, device: str, autocast: bool = True,
             windows: int | None = None) -> float:
    """Mean next-token NLL over consecutive held-out windows, all of them or the first `windows`
    (bf16 autocast on GPU unless told not to)."""
    n = (stream.numel() - 1) // cols
    n = min(n, windows) if windows else n
    rows = stream[: n * cols + 1]
    x = rows[:-1].reshape(n, cols)
    y = rows[1:].reshape(n, cols)
    total, count = 0.0, 0
    for i in range(0, n, 16):
        xb, yb = x[i:i + 16].to(device), y[i:i + 16].to(device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast and device == "cuda"):
            logits = model(xb)
        total += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="sum").item()
        count += yb.numel()
    return total / count


def train(args: argparse.Namespace) -> None:
    device = args.device
    torch.manual_seed(args.seed)
    raw = json.loads(args.config.read_text())
    cfg = ModelConfig.from_dict(raw, source=str(args.config))
    token_map = engram_token_map(cfg)
    train_ids = torch.from_numpy(np.load(args.cache / "train.npy").astype(np.int64))
    held_ids = torch.from_numpy(np.load(args.cache / "heldout.npy").astype(np.int64))

    model = DeepseekModel(cfg, torch.float32, token_map).to(device)
    init_parameters(model, seed=args.seed)
    # Selection biases are not learned by gradient (and V4's hash-routed layers have none).
    biases = {n[: -len(".ffn.gate.bias")]: b for n, b in model.named_buffers() if n.endswith("ffn.gate.bias")}
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda")

    counts: dict[str, torch.Tensor] = {}

    def on_routing(event: RoutingEvent) -> None:
        c = torch.bincount(event.expert_ids.flatten(), minlength=cfg.n_routed_experts).float()
        counts[event.layer] = counts.get(event.layer, 0) + c

    hooks = ForwardHooks(routing=on_routing)
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.rows, args.cols, gen)
    log = []
    t0 = time.time()
    for step in range(1, args.steps + 1):
        progress = min(1.0, max(step / args.steps, (time.time() - t0) / args.max_seconds))  # cosine over steps or time
        lr = args.lr * min(1.0, step / args.warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(data)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        counts.clear()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(x, hooks)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():  # DeepSeek's auxiliary-loss-free balancing: nudge the selection bias
            for layer, c in counts.items():
                if layer in biases:
                    biases[layer].add_(args.bias_rate * torch.sign(c.mean() - c).to(biases[layer].device))
        last = step == args.steps or progress >= 1.0
        if step % args.log_every == 0 or last:
            entry = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "seconds": round(time.time() - t0, 1)}
            if step % (args.log_every * 5) == 0 or last:
                model.eval()
                entry["heldout_nll"] = round(evaluate(model, held_ids, args.cols, device, windows=args.eval_windows), 4)
                model.train()
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if last:
            break
    record = {"config": args.config.name, "arch": cfg.arch, "steps": step, "log": log,
              "train_tokens": train_ids.numel(), "heldout_tokens": held_ids.numel(),
              "train_seconds": round(time.time() - t0, 1), "seed": args.seed, "rows": args.rows, "cols": args.cols,
              "lr": args.lr, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "heldout_windows": args.eval_windows or (held_ids.numel() - 1) // args.cols}
    model.eval()
    with torch.no_grad():  # the reference: the trained weights as a bf16 checkpoint would hold them
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    record["heldout_nll_bf16_weights"] = evaluate(model, held_ids, args.cols, device, autocast=False,
                                                  windows=args.eval_windows)
    native = export(model, raw, args.out, args.seed)
    from quantizer.checkpoint.source import Checkpoint

    shipped = DeepseekModel.from_checkpoint(Checkpoint.open(native), torch.float32, device).eval()
    record["heldout_nll_native_fp8_fp4"] = evaluate(shipped, held_ids, args.cols, device, autocast=False,
                                                    windows=args.eval_windows)
    (native / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "log"}, indent=1))


def engram_token_map(cfg: ModelConfig) -> torch.Tensor | None:
    """The tokenizer's compressed token map for Engram hashing (V4.1), or None without Engram."""
    if not cfg.engram_layer_ids:
        return None
    from quantizer.model.engram import compressed_token_map
    from tokenizers import Tokenizer

    token_map, size = compressed_token_map(Tokenizer.from_file(str(TOKENIZER)))
    assert size == cfg.engram_compressed_vocab_size, (size, cfg.engram_compressed_vocab_size)
    return token_map


def export(model: DeepseekModel, raw: dict, out: Path, seed: int) -> Path:
    """The native checkpoint in `out`, as DeepSeek ships the architecture (what the package bundles)."""
    state = {n: t.detach().float().cpu() for n, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)

    def values(spec: TensorSpec) -> torch.Tensor:
        name = spec.name
        if name.endswith("gate.bias_vl"):  # image-row selection bias: no image rows here
            name = name[: -len("_vl")]
        if name in state:
            return state[name]
        # The DSpark blocks have no forward, so they keep random initial weights of the right shape.
        shape = (spec.shape[0], spec.shape[1] * 2) if spec.dtype == "I8" else spec.shape
        return torch.randn(shape, generator=gen) * 0.02

    return write_native_checkpoint(out, raw, values, backbone_shards=2, extra_files={"tokenizer.json": TOKENIZER})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("--cache", type=Path, required=True)
    r = sub.add_parser("train")
    r.add_argument("--cache", type=Path, required=True)
    r.add_argument("--config", type=Path, default=CONFIG, help="the model shape (default: the V4.1 small model's)")
    r.add_argument("--out", type=Path, required=True, help="the model directory to write (must not exist or be empty)")
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--steps", type=int, default=3000)
    r.add_argument("--rows", type=int, default=64)
    r.add_argument("--cols", type=int, default=512)
    r.add_argument("--lr", type=float, default=3e-3)
    r.add_argument("--warmup", type=int, default=100)
    r.add_argument("--bias-rate", type=float, default=1e-3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--log-every", type=int, default=50)
    r.add_argument("--max-seconds", type=float, default=1e9,
                   help="time budget: the schedule anneals over steps or this many seconds, whichever ends first")
    r.add_argument("--eval-windows", type=int, default=None,
                   help="held-out windows to evaluate (default: all of them; fewer for a quick CPU check)")
    args = ap.parse_args()
    if args.cmd == "tokens":
        tokenize(args.cache)
    else:
        train(args)


if __name__ == "__main__":
    main()
