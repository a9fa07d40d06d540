"""The source fingerprint's cache of shard hashes: keyed by size, mtime, device and inode, so a hard link
(which moves ctime, docs/filesystem.md) is not a change and a written byte is."""

from __future__ import annotations

import os

from quantizer.checkpoint import fingerprint


def test_a_hard_linked_shard_is_not_hashed_again_but_a_written_one_is(tmp_path, monkeypatch):
    root = tmp_path / "src"
    root.mkdir()
    (root / "config.json").write_text("{}")
    shards = [root / f"model-{i}.safetensors" for i in range(2)]
    for i, s in enumerate(shards):
        s.write_bytes(bytes([i]) * 4096)
        os.utime(s, ns=(10**18, 10**18))  # an old mtime: the write below moves it at any clock granularity
    calls = []
    real = fingerprint.sha256_file
    monkeypatch.setattr(fingerprint, "sha256_file", lambda p, progress=None: calls.append(p) or real(p, progress))
    cache = tmp_path / "source.json"
    monkeypatch.setattr(fingerprint, "_HASHED", {})
    first = fingerprint.files_fingerprint(root, shards, cache)
    assert len(calls) == 2

    key = fingerprint._stat_key(shards[0])
    os.link(shards[0], tmp_path / "pack-shard.safetensors")  # what the pack does with an Engram shard
    st = shards[0].stat()  # the link moved ctime (docs/filesystem.md): the key holds everything but ctime
    assert fingerprint._stat_key(shards[0]) == key == (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)
    monkeypatch.setattr(fingerprint, "_HASHED", {})  # a new process: only the cache remembers
    assert fingerprint.files_fingerprint(root, shards, cache) == first and len(calls) == 2

    with open(shards[1], "r+b") as f:
        f.write(b"\xff")
    monkeypatch.setattr(fingerprint, "_HASHED", {})
    assert fingerprint.files_fingerprint(root, shards, cache) != first and calls[2:] == [shards[1]]
