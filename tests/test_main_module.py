"""`python -m quantizer` is the `quantizer` command: same parser, same exit codes, same one-line errors."""

from __future__ import annotations

import subprocess
import sys

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
