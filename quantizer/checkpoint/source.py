"""A native checkpoint opened lazily: config, tensor index and headers now, bytes on demand.

Accepts a directory (sharded with `model.safetensors.index.json`, or a single `model.safetensors`)
or a Hugging Face repo id at a revision, resolved through huggingface_hub's cache (which also works
offline once the files are cached).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.dequant import dequantize
from quantizer.checkpoint.safetensors_file import TensorEntry, read_header, read_tensor
from quantizer.errors import UserError
from quantizer.hub import repo_id_problem
from quantizer.report import size_text
from quantizer.workdir import free_bytes, require_free_space

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The source's files a loader reads beside the weights (tokenizer, chat template, generation defaults)
# and its licence terms: fetched with config and index from the hub, copied into every pack
# (pack/writer.py); nothing else of the source folder (notes, scripts, its README).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
              "generation_config.json", "LICENSE*", "LICENCE*", "NOTICE*")
DOWNLOAD_WORKERS = 8  # files a hub download fetches at once (huggingface_hub's snapshot_download)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_ENGRAM_TABLE = re.compile(r"^layers\.\d+\.engram\.embed\.(weight|scale)$")


def is_engram_table(name: str) -> bool:
    """Whether the tensor `name` belongs to an Engram table (`layers.L.engram.embed.weight` and its
    scale): the hashed n-gram rows, ~100 GB each in V4.1, read row by row, never loaded whole, and
    packed as shipped. The one answer to that question (model.tensor_classes.classify uses it too)."""
    return _ENGRAM_TABLE.match(name) is not None


@dataclass
class Checkpoint:
    root: Path
    config: ModelConfig
    tensors: dict[str, TensorEntry]
    shards: list[Path]
    include_engram: bool = True

    # ---- opening -----------------------------------------------------------------------------

    @classmethod
    def open(cls, src: str | Path, revision: str | None = None, include_engram: bool = True) -> "Checkpoint":
        """Open a checkpoint directory or a repo id; with include_engram=False the Engram tables
        (and shards that hold nothing else) are neither read nor required."""
        root = _resolve(src, revision, include_engram)
        config = ModelConfig.from_file(root / "config.json")
        index_path = root / INDEX_NAME
        if index_path.exists():
            weight_map = _read_index(index_path)
        elif (root / SINGLE_NAME).exists():
            weight_map = None
        else:
            raise UserError(f"{root}: no {INDEX_NAME} and no {SINGLE_NAME}; not a safetensors checkpoint")

        if weight_map is None:
            header = read_header(root / SINGLE_NAME)
            tensors = dict(header.tensors)
            shards = [root / SINGLE_NAME]
        else:
            wanted = {n: f for n, f in weight_map.items() if include_engram or not is_engram_table(n)}
            shards = [root / f for f in sorted(set(wanted.values()))]
            tensors = {}
            for shard in shards:
                header = read_header(shard)
                for name, entry in header.tensors.items():
                    if name in wanted:
                        tensors[name] = entry
            missing = sorted(set(wanted) - set(tensors))
            if missing:
                raise UserError(
                    f"{root}: {INDEX_NAME} puts {missing[0]} in {wanted[missing[0]]} but that shard does not hold it"
                    + (f" ({len(missing)} such tensors)" if len(missing) > 1 else "")
                    + "; the index and shards are from different downloads"
                )
        if not include_engram:
            tensors = {n: e for n, e in tensors.items() if not is_engram_table(n)}
        _check_scales(tensors)
        return cls(root, config, tensors, shards, include_engram)

    def with_tables_from(self, directory: Path) -> "Checkpoint":
        """This checkpoint with the tensors another directory's index names added: a pack whose engine
        reads the Engram tables from a directory beside it (the tensorfold profile) is measured with them."""
        index = directory / INDEX_NAME
        if not index.is_file():
            raise UserError(f"{directory}: no {INDEX_NAME}; {self.root}'s Engram tables are kept there: copy that "
                            "directory beside the pack as the build wrote it")
        weight_map = _read_index(index)
        found = {}
        for file in sorted(set(weight_map.values())):
            if not (directory / file).is_file():
                raise UserError(f"{directory / file}: missing; {index} names it (copy the directory again)")
            header = read_header(directory / file)
            found.update({n: e for n, e in header.tensors.items() if weight_map.get(n) == file})
        missing = sorted(set(weight_map) - set(found))
        if missing:
            raise UserError(f"{index} names {missing[0]}, which its shards do not hold; copy the directory again")
        return replace(self, tensors={**self.tensors, **found})

    # ---- access ------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise UserError(f"{self.root}: tensor {name} is not in the checkpoint")

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored, read from disk now."""
        return read_tensor(self.entry(name))

    def scale_name(self, name: str) -> str | None:
        """The `.scale` companion of an FP8/FP4 `X.weight` (stored as `X.scale`), if present."""
        if name.endswith(".weight"):
            s = name[: -len(".weight")] + ".scale"
            if s in self.tensors:
                return s
        return None

    def weight(self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
        """A tensor dequantized to `dtype` on `device` (FP8/FP4 with their E8M0 grids)."""
        scale = self.scale_name(name)
        return dequantize(self.raw(name), self.raw(scale) if scale else None, name, dtype, device)

    @property
    def payload_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())


def _resolve(src: str | Path, revision: str | None, include_engram: bool) -> Path:
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{path}: expected a checkpoint directory (config.json + safetensors)")
        if revision:
            raise UserError(f"{path}: --revision applies to Hugging Face repo ids, not local directories")
        return path
    why = _not_a_repo_id(str(src))
    if why:
        raise UserError(f"{src}: no such directory, and not a Hugging Face repo id ({why})")
    return _from_hub(str(src), revision, include_engram)


def _not_a_repo_id(src: str) -> str | None:
    """Why `src`, which names nothing on disk, is a mistyped path rather than a repo id (None: it may be one)."""
    problem = repo_id_problem(src)
    if problem:
        return problem
    owner = src.split("/")[0]
    return f"{owner}/ is a directory here, so this is a path" if Path(owner).exists() else None


def _from_hub(repo_id: str, revision: str | None, include_engram: bool) -> Path:
    """Find in the local cache, or fetch, config, index and side files, then the shards this job reads,
    each set as one huggingface_hub snapshot (parallel downloads, its progress bar). The shards come from
    the commit the index was read at, and the download's size is said, and checked against the cache's
    free space, before any shard is fetched. huggingface_hub itself decides whether the hub can be
    reached (HF_HUB_OFFLINE, proxies, its own time-outs); each refusal it raises becomes one line."""
    root = _snapshot(repo_id, revision, ["config.json", INDEX_NAME, *SIDE_FILES], "config.json",
                     lambda found: (found / "config.json").is_file()
                     and ((found / INDEX_NAME).is_file() or (found / SINGLE_NAME).is_file()))
    if not (root / "config.json").is_file():
        raise UserError(f"{_where(repo_id, revision)}: the repository has no config.json; is it a native "
                        "safetensors checkpoint?")
    if (root / INDEX_NAME).is_file():
        weight_map = _read_index(root / INDEX_NAME)
        files = sorted({f for n, f in weight_map.items() if include_engram or not is_engram_table(n)})
    else:
        files = [SINGLE_NAME]
    # A cached snapshot is a folder named by its commit: the shards are asked for at that commit, so a
    # branch that moves meanwhile cannot pair this index with another commit's shards.
    at = root.name if _COMMIT.fullmatch(root.name) else revision
    named = files[0] + (f" and {len(files) - 1} more shards" if len(files) > 1 else "")
    _snapshot(repo_id, revision, files, named, lambda found: all((found / f).is_file() for f in files), at=at,
              announce=True)
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        said = (f"its {INDEX_NAME} names {missing[0]}, which the repository does not hold" if files != [SINGLE_NAME]
                else f"the repository has no {INDEX_NAME} and no {SINGLE_NAME}")
        raise UserError(f"{_where(repo_id, revision)}: {said}; is it a native safetensors checkpoint?")
    return root


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], named: str,
              complete: Callable[[Path], bool], at: str | None = None, announce: bool = False) -> Path:
    """The snapshot folder holding the files of `patterns` at `at` (default: `revision`, the one asked
    for): the local cache's when `complete(folder)` says it has them, else fetched (`announce`: after
    saying how much it downloads, refused in one line when the cache's disk has too little free space)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    at = at or revision
    try:
        cached = Path(snapshot_download(repo_id, revision=at, allow_patterns=patterns, local_files_only=True))
        if complete(cached):
            return cached
    except LocalEntryNotFoundError:  # IncompleteSnapshotError is one
        pass
    try:
        if announce:
            plan = snapshot_download(repo_id, revision=at, allow_patterns=patterns, dry_run=True)
            fetched = [f for f in plan if f.will_download]
            need = sum(f.file_size or 0 for f in fetched)
            cache = Path(constants.HF_HUB_CACHE)
            require_free_space(cache, need, f"downloading {_where(repo_id, revision)} (HF_HUB_CACHE)")
            print(f"{_where(repo_id, revision)}: downloading {len(fetched)} of {len(plan)} files, {size_text(need)}, "
                  f"into {cache} ({size_text(free_bytes(cache))} free)", file=sys.stderr, flush=True)
        return Path(snapshot_download(repo_id, revision=at, allow_patterns=patterns,
                                      max_workers=DOWNLOAD_WORKERS))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - every refusal becomes one line; the rest keep their type
        raise _hub_refusal(repo_id, revision, named, e) from None


def _hub_refusal(repo_id: str, revision: str | None, named: str, e: Exception) -> UserError:
    """One line for what huggingface_hub raised fetching `named` (the order matters: a gated repo's
    error is a not-found error, a cache miss is an entry-not-found error; a dry run that cannot list
    the repository carries the hub's refusal as its cause, or the unreachable hub)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        DryRunError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, DryRunError) and isinstance(e.__cause__, HfHubHTTPError):
        e = e.__cause__
    where = _where(repo_id, revision)
    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(e, (LocalEntryNotFoundError, DryRunError)):
        return UserError(f"{where}: {named}: not in the local Hugging Face cache and the hub cannot be reached "
                         "(offline, HF_HUB_OFFLINE set, or no connection); download it first or pass a local directory")
    if isinstance(e, GatedRepoError):
        return UserError(f"{repo_id}: a gated repository this login has no access to; accept its terms at "
                         f"{constants.ENDPOINT}/{repo_id}, {login}, then rerun")
    if isinstance(e, RepositoryNotFoundError):
        return UserError(f"{repo_id}: no such repository on the hub, or a private one this login cannot see; "
                         f"check the id, or {login}")
    if isinstance(e, RevisionNotFoundError):
        return UserError(f"{repo_id}: no revision {revision!r} on the hub; check --revision")
    if isinstance(e, HfHubHTTPError):
        status = getattr(e.response, "status_code", None)
        if status in (401, 403):
            return UserError(f"{where}: the hub refused {named} (HTTP {status}); {login} with an account that "
                             "has access")
        return UserError(f"{where}: cannot fetch {named} (HTTP {status}); try again later or pass a local "
                         "directory")
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return UserError(f"{where}: cannot fetch {named} ({type(e).__name__}: {first}); check the connection "
                     "or pass a local directory")


def _where(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision or 'main'}"


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
        weight_map = data["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{path}: not a valid safetensors index (needs a weight_map object)")
    if not isinstance(weight_map, dict):
        raise UserError(f"{path}: weight_map is not an object")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file:
            raise UserError(f"{path}: weight_map puts {name} in {file!r}, not a shard file name in this directory")
    return weight_map


def _check_scales(tensors: dict[str, TensorEntry]) -> None:
    """Every FP8/FP4 weight needs an E8M0 grid that tiles it; checked from headers alone."""
    from quantizer.checkpoint.dequant import scale_block

    for name, e in tensors.items():
        if not name.endswith(".scale"):
            continue
        w = tensors.get(name[: -len(".scale")] + ".weight")
        if w is None:
            raise UserError(f"{e.path}: scale {name} has no matching .weight tensor")
        if e.dtype != "F8_E8M0":
            raise UserError(f"{e.path}: scale {name} has dtype {e.dtype}; native scales are F8_E8M0")
        shape = w.shape if w.dtype != "I8" else (*w.shape[:-1], w.shape[-1] * 2)
        scale_block(shape, e.shape, name)
    for name, e in tensors.items():
        if e.dtype in ("F8_E4M3", "I8") and not name.endswith(".scale"):
            s = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
            if s not in tensors:
                raise UserError(f"{e.path}: {e.dtype} tensor {name} has no .scale grid; it cannot be dequantized")
