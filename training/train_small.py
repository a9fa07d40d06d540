"""Train the small V4.1-architecture model that ships with quantizer, and export it natively.

    python training/train_small.py tokens --cache DIR             # here: tokenize train/heldout (needs zstandard)
    python training/train_small.py train --cache DIR --out DIR    # on a GPU: train, then export

The model is configs/models/small-v41.json (every V4.1 component: mHC, compressed attention with
Full/Reuse/Reindex layers, Engram, MoE with a shared expert; one DSpark block that has no forward
and so keeps its random initial weights). It trains on calibration/train.jsonl.zst with the
4096-token BPE tokenizer, and is exported as DeepSeek ships V4.1: FP8 e4m3 with 32x32 E8M0 grids,
MXFP4 routed experts, BF16/F32 elsewhere. training.json records the held-out NLL of the trained
weights rounded to bf16 and of the exported FP8/FP4 checkpoint, both computed in float32.
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

from quantizer.checkpoint.native_writer import write_native_checkpoint  # noqa: E402
from quantizer.model.config import ModelConfig  # noqa: E402
from quantizer.model.hooks import ForwardHooks, RoutingEvent  # noqa: E402
from quantizer.model.layout import TensorSpec  # noqa: E402
from quantizer.model.transformer import DeepseekModel, init_parameters  # noqa: E402

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
def evaluate(model: DeepseekModel, stream: torch.Tensor, cols: int, device: str, autocast: bool = True) -> float:
    """Mean next-token NLL over consecutive held-out windows (bf16 autocast on GPU unless told not to)."""
    n = (stream.numel() - 1) // cols
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
    raw = json.loads(CONFIG.read_text())
    cfg = ModelConfig.from_dict(raw)
    from quantizer.model.engram import compressed_token_map
    from tokenizers import Tokenizer

    token_map, size = compressed_token_map(Tokenizer.from_file(str(TOKENIZER)))
    assert size == cfg.engram_compressed_vocab_size, (size, cfg.engram_compressed_vocab_size)
    train_ids = torch.from_numpy(np.load(args.cache / "train.npy").astype(np.int64))
    held_ids = torch.from_numpy(np.load(args.cache / "heldout.npy").astype(np.int64))

    model = DeepseekModel(cfg, torch.float32, token_map).to(device)
    init_parameters(model, seed=args.seed)
    biases = {n: b for n, b in model.named_buffers() if n.endswith("ffn.gate.bias")}  # not learned by gradient
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
                bias = biases[f"{layer}.ffn.gate.bias"]
                bias.add_(args.bias_rate * torch.sign(c.mean() - c).to(bias.device))
        if step % args.log_every == 0 or step == args.steps:
            entry = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "seconds": round(time.time() - t0, 1)}
            if step % (args.log_every * 5) == 0 or step == args.steps:
                model.eval()
                entry["heldout_nll"] = round(evaluate(model, held_ids, args.cols, device), 4)
                model.train()
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if progress >= 1.0:
            break
    record = {"steps": step, "log": log, "train_tokens": train_ids.numel(), "heldout_tokens": held_ids.numel(),
              "train_seconds": round(time.time() - t0, 1), "seed": args.seed, "rows": args.rows, "cols": args.cols,
              "lr": args.lr, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    model.eval()
    with torch.no_grad():  # the reference: the trained weights as a bf16 checkpoint would hold them
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    record["heldout_nll_bf16_weights"] = evaluate(model, held_ids, args.cols, device, autocast=False)
    native = export(model, raw, args.out, args.seed)
    from quantizer.checkpoint.source import Checkpoint

    shipped = DeepseekModel.from_checkpoint(Checkpoint.open(native), torch.float32, device).eval()
    record["heldout_nll_native_fp8_fp4"] = evaluate(shipped, held_ids, args.cols, device, autocast=False)
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "log"}, indent=1))


def export(model: DeepseekModel, raw: dict, out: Path, seed: int) -> Path:
    """The native V4.1 checkpoint, as DeepSeek ships V4.1 (this is what the package bundles)."""
    state = {n: t.detach().float().cpu() for n, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)

    def values(spec: TensorSpec) -> torch.Tensor:
        name = spec.name
        if name.endswith("gate.bias_vl"):  # image-row selection bias: no image rows here
            name = name[: -len("_vl")]
        if name in state:
            return state[name]
        # The DSpark block has no forward, so it keeps random initial weights of the right shape.
        shape = (spec.shape[0], spec.shape[1] * 2) if spec.dtype == "I8" else spec.shape
        return torch.randn(shape, generator=gen) * 0.02

    native = out / "native"
    write_native_checkpoint(native, raw, values, backbone_shards=2, extra_files={"tokenizer.json": TOKENIZER})
    return native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("--cache", type=Path, required=True)
    r = sub.add_parser("train")
    r.add_argument("--cache", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
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
    args = ap.parse_args()
    if args.cmd == "tokens":
        tokenize(args.cache)
    else:
        train(args)


if __name__ == "__main__":
    main()
