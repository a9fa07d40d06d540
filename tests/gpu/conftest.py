"""Every GPU test starts from the same process state and leaves it as it found it.

Before each test the library's process-wide caches are dropped (`quantizer.caches.reset`), so no test
can pass or fail on what an earlier one cached; after it, the state a test could change and forget
to restore is compared with what it was before, and a difference fails the test naming it: the random
generators (CPU and CUDA), torch's threads, default dtype and backend flags, the current CUDA device,
the environment and the working directory. So `tests/gpu` gives the same results in any order;
QUANTIZER_TEST_ORDER=reverse runs it back to front to show that.
"""

from __future__ import annotations

import os

import pytest

from process_state import snapshot, state_changes
from quantizer import caches


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
