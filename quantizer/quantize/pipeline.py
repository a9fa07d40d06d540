"""Three-stage pipeline for the quantize stage: prepare the next unit while this one encodes, and save
the last one behind it, so the encoder (the GPU) never waits for the disk or the CPU.

prepare (one thread: read and dequantize weights, load Hessians) -> encode (the calling thread)
-> save (one thread: write the unit's result file). Units go through every stage in order, and each
unit's encode depends only on its own inputs and seeds, so the results are byte-identical to running
the three stages one after another (depth 0). An exception in any stage stops the pipeline and is
raised in the caller; a unit whose save did not finish is not done (results.py) and is redone on rerun.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

U = TypeVar("U")  # a work unit
P = TypeVar("P")  # its prepared inputs
E = TypeVar("E")  # its encoded result

PREFETCH_UNITS = 1  # units prepared ahead of the encoder (each holds its inputs in memory)
SAVE_BACKLOG = 1  # encoded units waiting to be written
POLL_S = 0.1
_DONE = object()


def run_pipeline(
    units: Iterable[U],
    prepare: Callable[[U], P],
    encode: Callable[[U, P], E],
    save: Callable[[U, E], None],
    depth: int = PREFETCH_UNITS,
) -> Iterator[U]:
    """Yield each unit once it is saved. At most `depth` prepared units wait beside the one encoding;
    depth 0 runs prepare, encode and save in turn in this thread. When the caller stops (an error, or
    closing the iterator) the units already encoded are still saved."""
    if depth == 0:
        for unit in units:
            save(unit, encode(unit, prepare(unit)))
            yield unit
        return
    stop = threading.Event()  # the caller is gone or the saver failed: no more work starts
    slots = threading.Semaphore(depth)
    prepared: queue.Queue = queue.Queue()
    encoded: queue.Queue = queue.Queue(maxsize=SAVE_BACKLOG)
    saved: queue.Queue = queue.Queue()
    failures: list[BaseException] = []

    def preparer() -> None:
        try:
            for unit in units:
                if not _wait(lambda: slots.acquire(timeout=POLL_S), stop):
                    return
                prepared.put((unit, prepare(unit)))
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            failures.append(e)
        prepared.put(_DONE)

    def saver() -> None:
        try:
            while (item := _get(encoded, stop)) is not None and item is not _DONE:
                save(*item)
                saved.put(item[0])
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            failures.append(e)
            stop.set()

    threads = [threading.Thread(target=preparer, name="quantize-prepare", daemon=True),
               threading.Thread(target=saver, name="quantize-save", daemon=True)]
    for t in threads:
        t.start()
    try:
        while (item := _get(prepared, stop)) is not None and item is not _DONE:
            slots.release()
            unit, inputs = item
            del item
            result = encode(unit, inputs)
            del inputs  # the GPU memory of this unit's weights is free before the next is prepared
            if not _wait(lambda: _offer(encoded, (unit, result)), stop):
                break
            del result
            yield from _drain(saved)
    finally:
        _wait(lambda: _offer(encoded, _DONE), stop)
        threads[1].join()  # the encoded backlog is saved whatever stopped the loop
        stop.set()
        threads[0].join()
    yield from _drain(saved)
    if failures:
        raise failures[0]


def _wait(attempt: Callable[[], bool], stop: threading.Event) -> bool:
    """Retry `attempt` until it succeeds (True) or `stop` is set (False)."""
    while not stop.is_set():
        if attempt():
            return True
    return False


def _offer(q: queue.Queue, item) -> bool:
    try:
        q.put(item, timeout=POLL_S)
        return True
    except queue.Full:
        return False


def _get(q: queue.Queue, stop: threading.Event):
    """The next item, or None once `stop` is set."""
    while not stop.is_set():
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            continue
    return None


def _drain(q: queue.Queue) -> Iterator:
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return
