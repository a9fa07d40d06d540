"""The library's process-wide caches are all made by quantizer/caches.py (bounded, keyed by hashable
values, dropped at once by `reset()`), and the state check the GPU suite runs around every test
(tests/gpu/conftest.py) sees what a test changes and forgets to restore."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from process_state import snapshot, state_changes

import quantizer
from quantizer import caches
from quantizer.checkpoint import fingerprint
from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.source import Checkpoint
from quantizer.codec import trellis
from quantizer.contract.loader_profiles import loader_names, load_profile
from quantizer.contract.pack_spec import native_tensors
from quantizer.model.targets import targets
from quantizer.shipped import model_config_path


def test_reset_drops_every_cache_the_library_fills(tiny_v41, tmp_path):
    trellis.unpack_trellis(torch.zeros(3, 32, dtype=torch.int16), 2.0)
    fingerprint.files_fingerprint(tiny_v41, Checkpoint.open(tiny_v41).shards)
    cfg = Checkpoint.open(tiny_v41).config
    native_tensors(cfg)
    assert trellis._unpack_index.cache_info().currsize and fingerprint._HASHED and caches.cached_entries()
    caches.reset()
    assert trellis._unpack_index.cache_info().currsize == 0 and not fingerprint._HASHED
    assert caches.cached_entries() == 0
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


def test_every_process_cache_is_made_by_caches_py():
    """No module keeps a cache of its own: no functools cache decorator and no module-level dict or
    OrderedDict outside quantizer/caches.py (a module constant that is a dict literal is data, not a
    cache, and is written in upper case without a leading underscore)."""
    root = Path(quantizer.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        if path.name == "caches.py" and path.parent == root:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    name = ast.unparse(d)
                    if "lru_cache" in name or name in ("cache", "functools.cache"):
                        found.append(f"{path.relative_to(root)}:{node.lineno} @{name}")
        for node in tree.body:  # module level only
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Dict, ast.Call)):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                value = node.value
                empty = (isinstance(value, ast.Dict) and not value.keys) or (
                    isinstance(value, ast.Call) and ast.unparse(value.func) in ("dict", "OrderedDict", "defaultdict"))
                if empty and isinstance(target, ast.Name):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {target.id} = {ast.unparse(value)}")
    assert not found, "process caches not made by quantizer/caches.py:\n" + "\n".join(found)


def test_a_cache_is_bounded_least_recently_used_and_refuses_an_unhashable_key():
    calls = []

    @caches.process_cache(maxsize=2)
    def square(x):
        calls.append(x)
        return x * x

    assert [square(1), square(2), square(1), square(3), square(1), square(2)] == [1, 4, 1, 9, 1, 4]
    assert calls == [1, 2, 3, 2]  # 2 was the least recently used when 3 came
    with pytest.raises(TypeError, match="unhashable"):
        square([1])
    with pytest.raises(ValueError, match="bounded"):
        caches.process_cache(maxsize=None)
    store = caches.ProcessStore(maxsize=2)
    store["a"], store["b"] = 1, 2
    assert store["a"] == 1
    store["c"] = 3
    assert list(store) == ["a", "c"]
    caches.reset()
    assert not store and square.cache_info().currsize == 0


def test_configs_and_profiles_key_caches_by_value():
    cfg = ModelConfig.from_file(model_config_path("tiny-v41.json"))
    same = dataclasses.replace(cfg, rope_scaling=dict(reversed(list(cfg.rope_scaling.items()))))
    other = dataclasses.replace(cfg, num_layers=cfg.num_layers + 1)
    annotated = dataclasses.replace(cfg, raw={**cfg.raw, "_name_or_path": "elsewhere"})  # raw is not compared
    assert same == cfg and hash(same) == hash(cfg) and hash(other) != hash(cfg)
    assert annotated == cfg and hash(annotated) == hash(cfg)
    assert targets(same) is targets(cfg) is targets(annotated)  # one cached index for equal configs
    profiles = [load_profile(name) for name in loader_names()]
    caches.reset()
    assert [load_profile(name) for name in loader_names()] == profiles
    assert {hash(p) for p in profiles} == {hash(load_profile(name)) for name in loader_names()}
