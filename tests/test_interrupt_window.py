"""Ctrl-C at any moment of a command's start is the one line "interrupted" and exit 130 (issue 60): the
signal is swept over the whole window, from spawn to past the moment the command begins its work, for
`verify` (reads) and `make-tiny` (writes), at offsets derived from a run nobody interrupts.

A Ctrl-C once main() has set its handler gets exactly the one line (or death by the signal, silently);
one before that is the interpreter's own start-up (its site module, the import of quantizer.cli), which
reports it as Python does. Never rc 0, and nothing half-written in the output's directory.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_build_guards import _build  # tests/ is on sys.path (pytest prepend import mode)
from test_main_module import CONSOLE_SCRIPT, _maps

pytestmark = pytest.mark.slow

OFFSETS = 10  # per command, over its measured window; the two commands' offsets interleave (same imports)


@dataclass(frozen=True)
class Trial:
    offset: float
    phase: str  # when the signal was sent: "start-up" (before main() set its handler), "main", or "ended" (it returned)
    began: bool  # the command had begun its work when the signal was sent
    rc: int
    out: str
    err: str


def _spawn(how: list[str], args: list[str]) -> subprocess.Popen:
    # As a shell starts it: SIGINT at its default (a library that ran earlier in this process may have left it ignored).
    return subprocess.Popen([sys.executable, *how, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _handler_set(pid: int) -> bool:
    """main() has set its handlers: the process catches SIGTERM (the interpreter alone catches only SIGINT)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _watch(proc: subprocess.Popen, until) -> str:
    """Watch `proc` until `until(phase)` holds; return its phase then: start-up, main or ended."""
    phase = "start-up"
    while True:
        if _handler_set(proc.pid):
            phase = "main"
        elif phase == "main" or proc.poll() is not None:
            phase = "ended"
        if until(phase):
            return phase
        time.sleep(0.002)


def _seconds_until(how: list[str], args: list[str], began) -> float:
    """Seconds from spawn until `began(phase)` holds, in a run nobody interrupts (killed there if still running)."""
    start = time.monotonic()
    proc = _spawn(how, args)
    _watch(proc, lambda phase: began(phase) or time.monotonic() - start > 300)
    seconds = time.monotonic() - start
    proc.kill()
    proc.communicate()
    assert seconds < 300, "the command never began"
    return seconds


def _sweep(how: list[str], args, window: float, shift: float, began, swept_past) -> list[Trial]:
    """SIGINT at window * (i + shift) / OFFSETS seconds after spawn for i = 0, 1, ..., on until a trial is past the
    command's start (`swept_past(trial)`). `args(i)` is trial i's arguments, `began(i)` whether its command has begun."""
    trials: list[Trial] = []
    step = window / OFFSETS
    for i in range(3 * OFFSETS):
        offset = step * (i + shift)
        start = time.monotonic()
        proc = _spawn(how, args(i))
        phase = _watch(proc, lambda phase: time.monotonic() >= start + offset)
        started = began(i)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
        trials.append(Trial(offset, phase, started, proc.returncode, out, err))
        if swept_past(trials[-1]):
            return trials
    raise AssertionError(f"the command had not begun {3 * window:.1f} s after spawn (a run took {window:.1f} s)")


def _check(trials: list[Trial], command: str) -> None:
    line = f"quantizer {command}: interrupted; rerun the same command to resume\n"
    for t in trials:
        if t.phase == "main":
            assert (t.rc, t.err) in ((130, line), (-signal.SIGINT, "")), t
        elif t.phase == "start-up":  # silent death, or the interpreter's own KeyboardInterrupt report; never rc 0
            assert t.out == "", t
            assert (t.rc, t.err) in ((130, line), (-signal.SIGINT, "")) or (
                t.rc in (1, -signal.SIGINT) and t.err.rstrip().endswith("\nKeyboardInterrupt")), t
    assert any(t.phase == "main" and not t.began for t in trials), trials  # the sweep went through the imports


@pytest.fixture(scope="module")
def pack(tiny_v41, fp16_plan, tmp_path_factory):
    out = tmp_path_factory.mktemp("interrupt") / "pack"
    assert _build(tiny_v41, fp16_plan, out) == 0
    return out


def test_ctrl_c_anywhere_in_verifys_start_is_the_one_line(pack):
    how = ["-m", "quantizer"]
    args = ["verify", str(pack)]
    window = _seconds_until(how, args, lambda phase: phase == "ended")  # spawn to main()'s return: its work done
    trials = _sweep(how, lambda i: args, window, 0.25, lambda i: False, lambda t: t.phase == "ended")
    _check(trials, "verify")


def test_ctrl_c_anywhere_in_make_tinys_start_is_the_one_line_and_writes_nothing_half(tiny_v41, tmp_path):
    how = ["-c", CONSOLE_SCRIPT]

    def out(i: int) -> Path:
        (tmp_path / f"try-{i}").mkdir(exist_ok=True)
        return tmp_path / f"try-{i}" / "ck"

    def began(i: int) -> bool:
        return any(out(i).parent.glob("ck.partial-*"))  # it writes the checkpoint there, then renames it

    window = _seconds_until(how, ["make-tiny", str(out(-1))], lambda phase: began(-1))
    trials = _sweep(how, lambda i: ["make-tiny", str(out(i))], window, 0.75, began, lambda t: t.began)
    _check(trials, "make-tiny")
    assert trials[-1].began and trials[-1].phase == "main", trials  # one signal came while the command wrote
    reference = {p.relative_to(tiny_v41): p.read_bytes() for p in tiny_v41.rglob("*") if p.is_file()}
    for i in range(len(trials)):
        left = list(out(i).parent.iterdir())
        assert left in ([], [out(i)]), left  # no partial directory, and no checkpoint unless a whole one
        if left:
            assert {p.relative_to(out(i)): p.read_bytes() for p in out(i).rglob("*") if p.is_file()} == reference


def test_sigterm_while_torch_is_imported_is_its_one_line_and_exit_143(tmp_path):
    """A scheduler's stop during the imports: the SIGTERM line, not a silent death by the signal."""
    proc = _spawn(["-m", "quantizer"], ["verify", str(tmp_path / "nothing")])
    deadline = time.monotonic() + 120
    while "libtorch" not in _maps(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert (proc.returncode, out, err) == (143, "", "quantizer verify: interrupted by SIGTERM; rerun the same command "
                                                    "to resume\n")
