"""Shared fixtures, built once per test session: tiny native checkpoints of both architectures and the
full-size sparse layout (well under a second each); the real V4.1-Flash shape with its uniform plans,
their pack specs and the synthetic-summary sensitivity (about a second of CPU each).

The `slow` marker: `make test-fast` runs `pytest -m "not slow"` for the inner loop; `make test` and CI
run everything. A test is slow where a file or test says so, and wherever it uses one of SLOW_FIXTURES,
module fixtures that build whole packs or run torchrun ranks (each costs seconds to a minute)."""

from __future__ import annotations

import functools
import shutil

import pytest

from quantizer.checkpoint.config import ModelConfig
from quantizer.checkpoint.source import Checkpoint
from quantizer.contract.pack_spec import pack_spec
from quantizer.contract.rules import make_plan
from quantizer.model.targets import targets
from quantizer.plan.sensitivity import sensitivity, synthetic_summary
from quantizer.plan.uniform import uniform_plan
from quantizer.shipped import model_config_path
from quantizer.tiny.make import make_tiny

SLOW_FIXTURES = {
    "one_spark_pack",  # test_one_spark.py: a one-Spark build of the bundled model
    "packs", "e2e_pack",  # test_tune.py: tuned builds
    "built",  # test_eval.py, test_build.py: a calibrated build
    "build_args", "reference",  # test_distributed.py: torchrun builds
}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


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


# ---- the real V4.1-Flash shape, shared by the planning tests of every module ----------------------
# A real-shape plan or pack spec costs about a second of CPU (96k targets); the modules that plan the
# real shape ask for the same few. Everything returned is shared: read it, never change it.


@pytest.fixture(scope="session")
def real_v41():
    """The DeepSeek-V4.1-Flash shape (configs/models/deepseek-v4.1-flash.json), its target index built."""
    cfg = ModelConfig.from_file(model_config_path("deepseek-v4.1-flash.json"))
    targets(cfg)
    return cfg


@pytest.fixture(scope="session")
def real_v41_uniform(real_v41):
    """bpw -> uniform_plan(real_v41, bpw), each made once per session."""
    return functools.cache(lambda bpw: uniform_plan(real_v41, bpw))


@pytest.fixture(scope="session")
def real_v41_uniform_spec(real_v41, real_v41_uniform):
    """bpw -> the pack spec of real_v41_uniform(bpw), each made once per session."""
    return functools.cache(lambda bpw: pack_spec(real_v41, real_v41_uniform(bpw)))


@pytest.fixture(scope="session")
def real_v41_synthetic_sensitivity(real_v41):
    """sensitivity(real_v41, synthetic_summary(real_v41)): what `--synthetic` plans allocate on."""
    return sensitivity(real_v41, synthetic_summary(real_v41))


@pytest.fixture
def src(tiny_v41, tmp_path):
    """A copy of the tiny V4.1 checkpoint a test may change."""
    return shutil.copytree(tiny_v41, tmp_path / "src")


@pytest.fixture(scope="session")
def fp16_plan(tiny_v41, tmp_path_factory):
    """A plan that encodes nothing (two linears kept as fp16, the rest native): a pack in seconds."""
    cfg = Checkpoint.open(tiny_v41).config
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    make_plan(cfg, {t.key: (16.0 if t.key.endswith("layers.0.attn.wq_a") else None) for t in targets(cfg)}).save(path)
    return path
