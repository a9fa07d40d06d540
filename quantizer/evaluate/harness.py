"""lm-evaluation-harness over quantizer's reference forward: a pack (its EXL3 linears decoded to the
weights a loader computes with) or a native checkpoint, on the CPU or one GPU.

`ForwardLM` is an `lm_eval.api.model.LM` registered as "quantizer". It scores loglikelihood requests
(multiple-choice and perplexity tasks) by running [BOS] + context + continuation through the streamed
forward. Sequences run in batches of one length only: the forward's logits at a position can depend on
the length of the row it is computed in, so padding would change scores. Generation tasks need an
engine with a KV cache (exllamav3 for V4 packs on a GPU) and are refused. A task whose dataset the hub
cannot give (unreachable, offline, no such dataset or no access to it) is one line (quantizer/hub.py).
docs/publishing.md has the harness interfaces used here.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import lm_eval.evaluator
import torch
from datasets.exceptions import DatasetNotFoundError
from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from quantizer.caches import process_cache
from quantizer.errors import UserError
from quantizer.hub import LOGIN, hub_failures
from quantizer.model.streaming import LayerStreamer, WeightSource
from quantizer.ppl.measure import forward_dtype, open_model, weight_source
from quantizer.textdata.tokenizer import load_tokenizer

MODEL_NAME = "quantizer"
DEFAULT_MAX_LENGTH = 2048
KEEP_WEIGHTS_BYTES = 4 << 30  # models up to this size keep their decoded weights between passes


class KeptWeights:
    """A weight source whose weights are decoded once and kept: the model runs once per sequence length,
    and decoding a pack's EXL3 linears again on every pass would cost more than the forward."""

    def __init__(self, source: WeightSource):
        self.source, self.config = source, source.config
        self.kept: dict[tuple, torch.Tensor] = {}

    def weight(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        key = (name, dtype, str(device))
        if key not in self.kept:
            self.kept[key] = self.source.weight(name, dtype, device)
        return self.kept[key]

    def table_rows(self, name: str, dtype: torch.dtype, device):
        return self.source.table_rows(name, dtype, device)

    def engram_token_map(self):
        return self.source.engram_token_map()


@register_model(MODEL_NAME)
class ForwardLM(LM):
    def __init__(self, model: str, device: str = "cpu", max_length: int = DEFAULT_MAX_LENGTH, batch_rows: int = 64):
        super().__init__()
        ck = open_model(model)
        source = weight_source(ck)
        if sum(e.nbytes for e in ck.tensors.values()) <= KEEP_WEIGHTS_BYTES:
            source = KeptWeights(source)
        self.streamer = LayerStreamer(source, device=device, dtype=forward_dtype(device), progress=False,
                                      report=lambda line: None)
        self.tokenizer = load_tokenizer(ck.root)
        self.bos = ck.config.bos_token_id
        self.max_length = min(int(max_length), ck.config.max_position_embeddings)
        self.batch_rows = int(batch_rows)
        self.name = str(model)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [([self.bos] + self._encode(context), self._encode(continuation))
                 for context, continuation in (r.args for r in requests)]
        return self._score(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, request in enumerate(requests):
            for window in get_rolling_token_windows(self._encode(request.args[0]), self.bos, self.max_length, 1):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise UserError("generation tasks need an engine with a KV cache; quantizer's forward scores "
                        "loglikelihood tasks (multiple choice, perplexity) only")

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) per pair."""
        seqs = [self._fit(context, continuation) for context, continuation in pairs]
        by_length = defaultdict(list)
        for i, (seq, _) in enumerate(seqs):
            by_length[len(seq)].append(i)
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        for length, members in sorted(by_length.items()):
            for start in range(0, len(members), self.batch_rows):
                chunk = members[start:start + self.batch_rows]
                rows = torch.tensor([seqs[i][0] for i in chunk], dtype=torch.int64)
                for i, row, logits in zip(chunk, rows, self.streamer.row_logits(rows)):
                    n = seqs[i][1]
                    logprobs = torch.log_softmax(logits[length - n - 1:length - 1].float(), dim=-1).cpu()
                    target = row[length - n:]
                    picked = logprobs.gather(-1, target[:, None])[:, 0]
                    out[i] = (float(picked.double().sum()), bool((logprobs.argmax(-1) == target).all()))
        return out

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """The sequence to run (context cut from the left to fit max_length) and the continuation's length."""
        if not continuation:
            raise UserError("an lm-eval request with an empty continuation; check the task's doc_to_target")
        keep = max(self.max_length - len(continuation), 1)
        return context[-keep:] + continuation, len(continuation)


@process_cache(maxsize=4)
def task_manager(include_path: str | None) -> TaskManager:
    """lm-eval's task index (with `include_path`'s tasks): about 10 s to build, so `eval --against` builds
    it once for the source and the pack."""
    return TaskManager(include_path=include_path)


def require_tasks(tasks: list[str], include_path: Path | None = None) -> TaskManager:
    """lm-eval's task index, once every task in `tasks` is in it (UserError naming those that are not)."""
    manager = task_manager(str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {include_path}" if include_path else "; give a task directory with --include-path"
        raise UserError(f"unknown lm-eval task(s) {', '.join(unknown)}: not in lm-eval's tasks{where}")
    return manager


def evaluate(model: str, tasks: list[str], include_path: Path | None = None, limit: int | None = None,
             device: str = "cpu", max_length: int = DEFAULT_MAX_LENGTH) -> dict:
    """lm-eval's results for `model` (pack or checkpoint), with per-document samples."""
    manager = require_tasks(tasks, include_path)
    print(f"eval: {model} on {', '.join(tasks)}", file=sys.stderr)
    lm = ForwardLM(model, device=device, max_length=max_length)
    what = f"the dataset of {', '.join(tasks)}"
    try:
        with hub_failures(what), _no_git_probe():
            results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=True,
                                      bootstrap_iters=0)
    except DatasetNotFoundError as e:  # no such dataset on the hub, or (gated, private) none this login may read
        raise UserError(f"{what}: {str(e).strip().splitlines()[0]}; check the task, and for a gated dataset "
                        f"accept its terms on the hub and {LOGIN}") from None
    if results is None:
        raise UserError("lm-eval returned no results")
    return results


@contextmanager
def _no_git_probe():
    """lm-eval records `git describe` of the working directory in its results, and outside a repository git
    prints "fatal: not a git repository" on every eval; that field describes no pack, so it is left empty."""
    probe = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = probe


def document_scores(results: dict, task: str) -> dict[int, dict[str, float]]:
    """document id -> {metric: value} for the metrics lm-eval reports per document (numbers only)."""
    scores = {}
    for sample in results["samples"].get(task, []):
        metrics = sample.get("metrics") or [k for k in sample if k not in ("doc", "doc_id", "target")]
        scores[sample["doc_id"]] = {m: float(sample[m]) for m in metrics
                                    if isinstance(sample.get(m), (int, float)) and not isinstance(sample.get(m), bool)}
    return scores
