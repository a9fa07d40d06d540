"""Every GPU test starts from the same process state and leaves it as it found it.

Before each test the library's process-wide caches are dropped (`quantizer.caches.reset`), so no test
can pass or fail on what an earlier one cached; after it, the state a test could change and forget
to restore is compared with what it was before, and a difference fails the test naming it: the random
generators (CPU and CUDA), torch's threads, default dtype and backend flags, the current CUDA device,
the environment and the working directory. So `tests/gpu` gives the same results in any order;
QUANTIZER_TEST_ORDER=reverse runs it back to front to show that.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
from process_state import snapshot, state_changes

from quantizer import caches


@pytest.fixture(scope="session", autouse=True)
def exllamav3_imported_first():
    """Importing exllamav3 sets two environment variables once per process (ROCPROFILER_REGISTER_ENABLED in
    its `__init__`, TOKENIZERS_PARALLELISM in its tokenizer module): import it before any test, so the
    check below sees what a test changes, not which test happened to import it first."""
    if importlib.util.find_spec("exllamav3") is not None:
        importlib.import_module("exllamav3")


@pytest.fixture(autouse=True)
def same_process_state_before_and_after():
    caches.reset()
    before = snapshot()
    yield
    changes = state_changes(before, snapshot())
    assert not changes, "the test changed process state without restoring it: " + "; ".join(changes)


def pytest_collection_modifyitems(config, items):
    """The second order the suite is run in: every test after the ones it followed before."""
    if os.environ.get("QUANTIZER_TEST_ORDER") == "reverse":
        items.reverse()
