"""Process-wide caches, registered where they are made, so that a long-lived process (a test session,
a notebook, a service building several packs) can drop every one of them at once with `reset()`.

A cache here must never change a result, only save time; `reset()` makes that checkable: the GPU
suite resets before every test (tests/gpu/conftest.py), so a test cannot pass or fail because of
what an earlier test left behind.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")
_RESETS: list[Callable[[], None]] = []


def process_cache(cache: T) -> T:
    """Register an `lru_cache`d function or a dict (returned unchanged, so it reads as a decorator)."""
    _RESETS.append(cache.cache_clear if hasattr(cache, "cache_clear") else cache.clear)
    return cache


def on_reset(fn: Callable[[], None]) -> Callable[[], None]:
    """Register a function that puts back a process-wide state other than a cache (a joined process group)."""
    _RESETS.append(fn)
    return fn


def reset() -> None:
    """Drop every registered cache and state; the next use rebuilds what it needs."""
    for fn in _RESETS:
        fn()
