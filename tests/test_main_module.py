"""`python -m quantizer` is the `quantizer` command: same parser, same exit codes, same one-line errors, and
Ctrl-C from the very first moment (while torch is imported) is the one line "interrupted", exit 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantizer import __version__


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantizer", *args], capture_output=True, text=True, timeout=300)


def test_python_m_quantizer_runs_the_command():
    done = _run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"quantizer {__version__}"


def test_python_m_quantizer_reports_a_user_error_in_one_line_with_exit_2(tmp_path):
    done = _run("verify", str(tmp_path / "nothing"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"quantizer verify: error: {tmp_path / 'nothing'}: not a directory; "
                                                "pass the pack directory that holds manifest.json"]


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to python")
def test_torchrun_m_quantizer_runs_the_command_on_every_rank_of_one_group(tmp_path):
    """`torchrun --nproc-per-node N -m quantizer build ...` is how a job of several processes starts
    (tests/test_distributed.py builds with it); each rank joins the group, so its error names its rank."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(31500 + os.getpid() % 1000),
                           "-m", "quantizer", "verify", str(tmp_path / "nothing")], env=env, capture_output=True,
                          text=True, timeout=300)
    errors = sorted(line for line in done.stdout.splitlines() + done.stderr.splitlines() if ": error: " in line)
    assert done.returncode != 0 and errors == [f"quantizer verify (rank {r} of 2): error: {tmp_path / 'nothing'}: not a "
                                               "directory; pass the pack directory that holds manifest.json"
                                               for r in (0, 1)], done.stderr


# What pip's console script `quantizer` runs (its entry point, quantizer.cli:main).
CONSOLE_SCRIPT = "import sys; from quantizer.cli import main; sys.exit(main())"


@pytest.mark.parametrize("how", [["-m", "quantizer"], ["-c", CONSOLE_SCRIPT]])
def test_ctrl_c_while_torch_is_imported_is_one_line_and_exit_130(how, tmp_path):
    """Ctrl-C in the first second of any command, while `import torch` runs (before the command began),
    is the one line a Ctrl-C always gives, not a traceback. The signal is sent once torch's shared
    libraries are mapped into the process: it is then inside `import torch`, which takes most of a second."""
    # As a shell starts it: SIGINT at its default. A child inherits an ignored SIGINT, and a library that
    # ran earlier in this test process may have left it ignored (Python then keeps it ignored in the child).
    proc = subprocess.Popen([sys.executable, *how, "verify", str(tmp_path / "nothing")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while "libtorch" not in _maps(proc.pid):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "torch was never imported"
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert (proc.returncode, out, err) == (130, "", "quantizer verify: interrupted; rerun the same command to resume\n")


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""
