"""`quantizer eval PACK --tasks T[,T...] [--against SRC] [--include-path DIR] [--limit N] [--device cpu|cuda]`

Runs lm-evaluation-harness tasks (the `eval` extra: pip install 'quantizer[eval]') on PACK through
quantizer's reference forward and, with --against, on its source too, then prints per task and metric
both scores and the paired difference (pack - source) with its standard error. A pack is compared only
with the checkpoint it was built from (same content fingerprint), and scored only once its manifest's
claims and every shard's sha256 check, as `ppl` does (a flipped byte would score plausibly and wrongly).
Loglikelihood tasks only (multiple choice, perplexity); --include-path adds a directory of task YAML
files (e.g. a local JSONL task). A task's dataset the hub cannot give (unreachable, offline, no access)
is one line.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from quantizer.commands.arguments import add_device_argument, count
from quantizer.errors import UserError
from quantizer.evaluate.paired import PairedScore, paired_scores
from quantizer.pack.manifest import MANIFEST_NAME, is_pack
from quantizer.ppl.measure import open_measured
from quantizer.report import table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="lm-evaluation-harness tasks on a pack and its source, with paired differences")
    p.add_argument("pack", help="pack directory (or a native checkpoint, scored alone)")
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    p.add_argument("--against", metavar="SRC", help="the native checkpoint the pack was built from: score it too")
    p.add_argument("--include-path", type=Path, help="directory of extra lm-eval task YAML files")
    p.add_argument("--limit", type=count, help="at most this many documents per task")
    add_device_argument(p, "where the pack (and its source) runs: cpu in float32, cuda in bfloat16")
    p.add_argument("--max-length", type=count, default=2048, help="tokens per scored sequence (context cut from the left)")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from quantizer.evaluate import harness
    except ImportError as e:
        raise UserError(f"quantizer eval needs lm-evaluation-harness ({e.name} is missing): "
                        "pip install 'quantizer[eval]'") from None
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks: give at least one lm-eval task name")
    harness.require_tasks(tasks, args.include_path)  # seconds, before a pack of hundreds of GiB is hashed
    if args.against and not is_pack(args.pack):
        raise UserError(f"{args.pack}: not a pack (no {MANIFEST_NAME}); --against compares a pack with its source")
    open_measured(args.pack, args.against)
    run_on = lambda model: harness.evaluate(model, tasks, args.include_path, args.limit, args.device,  # noqa: E731
                                            args.max_length)
    pack_results = run_on(args.pack)
    source_results = run_on(args.against) if args.against else pack_results
    scores = [s for task in tasks for s in paired_scores(
        task, harness.document_scores(source_results, task), harness.document_scores(pack_results, task))]
    print(json.dumps([asdict(s) for s in scores], indent=1) if args.json else render(scores, bool(args.against)))
    return 0


def render(scores: list[PairedScore], paired: bool) -> str:
    if not paired:
        return table(["task", "metric", "documents", "score"],
                     [[s.task, s.metric, f"{s.documents:,}", f"{s.pack:.4f}"] for s in scores])
    rows = [[s.task, s.metric, f"{s.documents:,}", f"{s.source:.4f}", f"{s.pack:.4f}",
             f"{s.delta:+.4f} ± {s.delta_stderr:.4f}"] for s in scores]
    return table(["task", "metric", "documents", "source", "pack", "pack - source (paired)"], rows)
