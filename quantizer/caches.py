"""Process-wide caches, made here so that every one is bounded, keyed by hashable values, and registered:
a long-lived process (a test session, a notebook, a service building several packs) can drop every one
of them at once with `reset()`.

A cache here must never change a result, only save time; `reset()` makes that checkable: the GPU
suite resets before every test (tests/gpu/conftest.py), so a test cannot pass or fail because of
what an earlier test left behind. One eviction rule for all: least recently used, at a size each
cache states.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)
_RESETS: list[Callable[[], None]] = []
_SIZES: list[Callable[[], int]] = []


def process_cache(maxsize: int) -> Callable[[F], F]:
    """Memoize a function in a registered LRU of `maxsize` entries. Its arguments are the key, so they
    must be hashable values (a frozen dataclass with `value_hash`, a str, a tuple): an unhashable
    argument is a TypeError at the call, never a silent miss."""
    if not isinstance(maxsize, int) or maxsize < 1:
        raise ValueError(f"process_cache: maxsize {maxsize!r}; every process cache is bounded (an int >= 1)")

    def wrap(fn: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _RESETS.append(cached.cache_clear)
        _SIZES.append(lambda: cached.cache_info().currsize)
        return cached  # type: ignore[return-value]

    return wrap


class ProcessStore(OrderedDict):
    """A registered LRU mapping for what is filled from more than one place (a file-hash cache that
    hashes in threads and is seeded from disk); a lookup marks an entry as recently used."""

    def __init__(self, maxsize: int):
        super().__init__()
        if not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"ProcessStore: maxsize {maxsize!r}; every process cache is bounded (an int >= 1)")
        self.maxsize = maxsize
        _RESETS.append(self.clear)
        _SIZES.append(lambda: len(self))

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


def value_hash(obj) -> int:
    """A frozen dataclass's hash from the fields its equality compares (a ModelConfig's `raw` is not one),
    dicts and lists included (a dataclass's own hash refuses them), so equal objects hash equal and may
    key a process cache. Cheap, as every call of a cached function hashes its key."""
    return hash(tuple(_hashable(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.compare))


def _hashable(value):
    if isinstance(value, dict):
        return frozenset((k, _hashable(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def on_reset(fn: Callable[[], None]) -> Callable[[], None]:
    """Register a function that puts back a process-wide state other than a cache (a joined process group)."""
    _RESETS.append(fn)
    return fn


def cached_entries() -> int:
    """How many entries every registered cache holds together (0 right after `reset()`)."""
    return sum(size() for size in _SIZES)


def reset() -> None:
    """Drop every registered cache and state; the next use rebuilds what it needs."""
    for fn in _RESETS:
        fn()
