"""Several processes, one job: the torch.distributed context the stages share.

`torchrun --nproc-per-node N -m quantizer build ...` starts one process per GPU (and per host with
--nnodes), each running the `quantizer` command (quantizer/__main__.py), and sets RANK, WORLD_SIZE and
LOCAL_RANK; `join_from_env` joins them into one process group: gloo for CPU tensors and, where CUDA
is visible, NCCL for CUDA tensors (each process on GPU LOCAL_RANK). Control messages (settings,
errors, small results) always travel over gloo. Without torchrun there is one rank, no process group,
and every helper here is a no-op, so a stage runs exactly as it does in one process.

Rank 0 is the one that owns the work directory: it takes the job lock, writes the job records, the
plan and the pack; a UserError it raises is raised on every rank, so all exit with the same line.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from quantizer import __version__
from quantizer.caches import on_reset
from quantizer.errors import UserError
from quantizer.workdir import job_lock

T = TypeVar("T")
# Ranks wait at barriers while rank 0 alone packs (hours for the real model) or a slower rank finishes.
WAIT = timedelta(hours=12)
SHARED_CHECK = ".shared-check"
CODE_ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    control: object | None = field(default=None, compare=False)  # the gloo group; None: no process group

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def joined(self) -> bool:
        return self.control is not None

    def barrier(self) -> None:
        if self.joined:
            dist.barrier(group=self.control)

    # --- tensors -------------------------------------------------------------------------------

    def sum_to_main(self, t: torch.Tensor) -> None:
        """t summed over the ranks, in place on rank 0 (others keep a partial). Sum float64 partials
        of float32 values and the result does not depend on how many ranks there were."""
        if self.joined:
            dist.reduce(t, dst=0)

    def from_main(self, t: torch.Tensor) -> None:
        """Rank 0's t, in place on every rank."""
        if self.joined:
            dist.broadcast(t, src=0)

    def gather_parts(self, parts: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's `parts` (the same number on each, each [n_i, ...] with equal trailing shape and
        dtype), in rank order, on every rank."""
        if not self.joined:
            return [parts]
        lengths = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        every = [torch.empty_like(lengths) for _ in range(self.world)]
        dist.all_gather(every, lengths, group=self.control)
        like = parts[0]
        # raw bytes: gloo knows neither bf16 nor int16
        flat = torch.cat([p.flatten(1).cpu().contiguous().view(torch.uint8) for p in parts])
        longest = max(int(n.sum()) for n in every)
        padded = torch.zeros(longest, *flat.shape[1:], dtype=flat.dtype)
        padded[:len(flat)] = flat
        received = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(received, padded, group=self.control)
        out = []
        for n, data in zip(every, received):
            pieces = data[:int(n.sum())].split(n.tolist())
            out.append([p.view(like.dtype).reshape(len(p), *like.shape[1:]).to(like.device) for p in pieces])
        return out

    # --- objects -------------------------------------------------------------------------------

    def gather(self, obj) -> list:
        """Every rank's obj (picklable), in rank order, on every rank."""
        if not self.joined:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def share(self, obj: T) -> T:
        """Rank 0's obj on every rank."""
        if not self.joined:
            return obj
        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def on_main(self, fn: Callable[[], T]) -> T:
        """fn() run by rank 0 alone, its result returned on every rank; a UserError it raises is raised
        on every rank, so no rank waits for one that has stopped. Any other exception (a full disk, a
        permission) stays rank 0's own, and the other ranks stop with one line naming it."""
        if not self.joined:
            return fn()
        result, error, failure = None, None, None
        if self.main:
            try:
                result = fn()
            except UserError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks are told
                error = f"rank 0 stopped: {_describe(e)}; its own output says more"
                failure = e
        result, error = self.share((result, error))
        if failure is not None:
            raise failure
        if error is not None:
            raise UserError(error)
        return result

    @contextmanager
    def lock(self, work: Path):
        """The work directory's job lock, held by rank 0 for the whole block (the other ranks work under
        it, they do not take it); the block ends for all ranks together."""
        with ExitStack() as stack:
            self.on_main(lambda: stack.enter_context(job_lock(work)))
            yield
            self.barrier()

    # --- work ----------------------------------------------------------------------------------

    def contiguous(self, n: int) -> range:
        """This rank's contiguous share of n ordered items; rank 0 has the first whenever there is one."""
        return range(-(-self.rank * n // self.world), -(-(self.rank + 1) * n // self.world))

    def spread(self, weights: list[int]) -> list[int]:
        """Indices of the items this rank does: largest first, each onto the least loaded rank (ties to
        the lower rank, then the earlier item), so every rank computes the same split."""
        loads = [0] * self.world
        mine = []
        for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
            r = min(range(self.world), key=lambda r: (loads[r], r))
            loads[r] += weights[i]
            if r == self.rank:
                mine.append(i)
        return sorted(mine)

    # --- checks --------------------------------------------------------------------------------

    def agree(self, what: dict) -> None:
        """UserError naming the first setting on which a rank differs from rank 0: every rank must run
        the same command on the same inputs with the same code."""
        every = self.gather(_flat(what))
        for r, theirs in enumerate(every[1:], 1):
            for key in sorted(every[0].keys() | theirs.keys()):
                if every[0].get(key) != theirs.get(key):
                    raise UserError(f"rank {r} disagrees with rank 0 on {key}: {theirs.get(key)!r} vs "
                                    f"{every[0].get(key)!r}; run the same command, inputs and quantizer "
                                    "version on every rank")

    def check_shared(self, directory: Path) -> None:
        """UserError unless every rank sees the file rank 0 writes in `directory`: the ranks of a job
        share one work directory (on several hosts, a shared filesystem at the same path). Call it once
        rank 0 has claimed `directory`, so nothing is written into a directory that is not a work one."""
        if not self.joined:
            return
        path = Path(directory) / SHARED_CHECK

        def write() -> str:
            path.parent.mkdir(parents=True, exist_ok=True)
            token = secrets.token_hex(16)
            path.write_text(token)
            return token

        token = self.on_main(write)
        try:
            seen = path.read_text() == token
        except OSError:
            seen = False
        every = self.gather((seen, socket.gethostname()))
        self.barrier()
        if self.main:
            path.unlink(missing_ok=True)
        for r, (ok, host) in enumerate(every):
            if not ok:
                raise UserError(f"{directory}: rank {r} (host {host}) does not see the file rank 0 wrote there; "
                                "every rank must share one work directory (a shared filesystem, at the same path)")


def _describe(e: Exception) -> str:
    """One line for an exception: an OSError's file and reason, else its type and message."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return f"{type(e).__name__}: {e}"


def _flat(what: dict, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys, so a difference names the setting itself."""
    out = {}
    for key, value in what.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def code_fingerprint() -> str:
    """The quantizer's version and a hash of its source files: ranks must run the same code."""
    h = hashlib.sha256()
    for path in sorted(CODE_ROOT.rglob("*")):
        if path.suffix in (".py", ".cpp"):
            h.update(path.relative_to(CODE_ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{__version__} sha256:{h.hexdigest()[:16]}"


_current = Ranks()


def current() -> Ranks:
    """The context of this process: one rank unless join_from_env joined a torchrun group."""
    return _current


def join_from_env() -> Ranks:
    """Join the torchrun group this process was started in (RANK, WORLD_SIZE, LOCAL_RANK set), once;
    without torchrun, the one-rank context."""
    global _current
    if _current.joined or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return _current
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=WAIT)
    control = dist.new_group(backend="gloo", timeout=WAIT)
    _current = Ranks(dist.get_rank(), dist.get_world_size(), local_rank, control)
    return _current


@on_reset
def leave() -> None:
    """Destroy the process group, if one was joined (at the end of the command)."""
    global _current
    if _current.joined:
        dist.destroy_process_group()
        _current = Ranks()

