"""The library's process-wide caches can all be dropped at once, and the state check the GPU suite runs
around every test (tests/gpu/conftest.py) sees what a test changes and forgets to restore."""

from __future__ import annotations

import torch
from process_state import snapshot, state_changes

from quantizer import caches
from quantizer.checkpoint import fingerprint
from quantizer.checkpoint.source import Checkpoint
from quantizer.codec import trellis
from quantizer.plan import exl3_baseline


def test_reset_drops_every_cache_the_library_fills(tiny_v41, tmp_path):
    trellis.unpack_trellis(torch.zeros(3, 32, dtype=torch.int16), 2.0)
    fingerprint.files_fingerprint(tiny_v41, Checkpoint.open(tiny_v41).shards)
    exl3_baseline._MODELS["probe"] = ()
    assert trellis._unpack_index.cache_info().currsize and fingerprint._HASHED and exl3_baseline._MODELS
    caches.reset()
    assert trellis._unpack_index.cache_info().currsize == 0
    assert not fingerprint._HASHED and not exl3_baseline._MODELS
    # and what is rebuilt after a reset is what was there before
    again = trellis.unpack_trellis(torch.arange(96, dtype=torch.int16).view(3, 32), 2.0)
    caches.reset()
    assert torch.equal(again, trellis.unpack_trellis(torch.arange(96, dtype=torch.int16).view(3, 32), 2.0))


def test_state_changes_names_what_was_not_restored(monkeypatch):
    before = snapshot()
    assert state_changes(before, snapshot()) == []
    torch.rand(1)  # draws from the global generator
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
    monkeypatch.setenv("QUANTIZER_PROBE", "1")
    try:
        changes = state_changes(before, snapshot())
    finally:
        torch.set_num_threads(threads)
    assert any(c.startswith("torch CPU random generator") for c in changes)
    assert any(c.startswith("torch threads") for c in changes)
    assert "environment variables QUANTIZER_PROBE" in changes
    monkeypatch.delenv("QUANTIZER_PROBE")
    restored = snapshot()
    with torch.random.fork_rng():  # what the exllamav3 adapter does around exllamav3's own seeding
        torch.manual_seed(1234)
        torch.rand(1)
    assert state_changes(restored, snapshot()) == []
