"""Shared fixtures: tiny native checkpoints of both architectures and the full-size sparse layout,
built once per test session (they take well under a second each)."""

from __future__ import annotations

import pytest

from quantizer.tiny.make import make_tiny


@pytest.fixture(scope="session")
def tiny_v41(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("ck") / "tiny-v41", "v41", seed=0)


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("ck") / "tiny-v4", "v4", seed=0)


@pytest.fixture(scope="session")
def full_v41(tmp_path_factory):
    """The real V4.1-Flash layout as sparse files: exact headers, no data on disk."""
    return make_tiny(tmp_path_factory.mktemp("ck") / "full-v41", "v41", full_size=True, sparse=True)
