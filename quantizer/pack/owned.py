"""What a pack owns: exactly the files its manifest names. verify and publish both ask here.

A pack directory owns its shards, manifest.json, its card (README.md) and the files the pack stage
recorded in the manifest's `files` (the index, config.json, quantization_config.json, k_map.json, the
tokenizer and generation files copied from the source, and whatever a loader profile writes: recording a file at
pack time is all it takes to make it part of the pack). Anything else at the top level is a stray,
and so is every symbolic link, whatever its name: a link can point out of the pack (at /etc/passwd as
easily as at a shard), and nothing of the pack is ever read through one. Hidden entries (a name that
starts with '.') are not part of the pack and are left alone: huggingface_hub keeps an upload's resume
records in `.cache/` inside the folder it uploads. A profile that keeps the Engram tables in a sibling
directory (`<pack>-Engram`) owns there the source shards the manifest names and their index.
"""

from __future__ import annotations

from pathlib import Path

from quantizer.checkpoint.source import INDEX_NAME
from quantizer.pack.card import CARD_NAME
from quantizer.pack.manifest import MANIFEST_NAME, FileRecord, Manifest

SYMLINK = "a symbolic link"
ENGRAM_SUFFIX = "-Engram"  # TensorFold also finds a folder beside the model whose name holds "Engram"


def owned_files(manifest: Manifest) -> list[str]:
    """The names of the files the pack directory owns, sorted."""
    return sorted({s.file for s in manifest.shards} | set(manifest.files) | {MANIFEST_NAME, CARD_NAME})


def engram_files(manifest: Manifest) -> list[str]:
    """The names of the files the sibling Engram directory owns (none where the profile has no such directory)."""
    sibling = manifest.plan.get("engram_dir")
    return sorted([*sibling["shards"], INDEX_NAME]) if sibling else []


def engram_dir_of(out: Path) -> Path:
    """The sibling directory of a pack that holds the original Engram shards (profiles with
    engram_tables "sibling": TensorFold reads them with --engram DIR / TF_DS_ENGRAM)."""
    return out.with_name(out.name + ENGRAM_SUFFIX)


def engram_dir(pack: Path, manifest: Manifest) -> Path | None:
    """The pack's sibling Engram directory, where its manifest records one (None where it does not)."""
    info = manifest.plan.get("engram_dir")
    if not info:
        return None
    where = pack.parent / info.get("dir", pack.name + ENGRAM_SUFFIX)
    if not where.is_dir():  # a pack checked before it is published: its sibling still has the partial's name
        where = engram_dir_of(pack)
    return where


def engram_records(pack: Path, manifest: Manifest) -> dict[Path, FileRecord]:
    """The sibling Engram directory's shards with the size and sha256 the pack stage recorded (the source's),
    by path; empty where the profile keeps no sibling or the pack predates the record."""
    where = engram_dir(pack, manifest)
    files = (manifest.plan.get("engram_dir") or {}).get("files", {})
    return {where / name: FileRecord(**record) for name, record in files.items()} if where else {}


def strays(directory: Path, owned: list[str]) -> dict[str, str]:
    """Entry name -> what it is, for every entry of `directory` that is not an owned regular file:
    an unowned file or directory, an owned name that is not a regular file, and every symbolic link."""
    owned, found = set(owned), {}
    for entry in sorted(Path(directory).iterdir()):
        if entry.is_symlink():
            found[entry.name] = SYMLINK
        elif entry.name.startswith("."):
            continue
        elif entry.name not in owned:
            found[entry.name] = f"a {'directory' if entry.is_dir() else 'file'} the manifest does not name"
        elif not entry.is_file():
            found[entry.name] = "not a regular file"
    return found
