"""What every refusal a user can fix must look like: the run ends on exactly one `error:` line, holding
what the test names, and prints no traceback (quantizer/cli.py)."""


def one_line(err: str, *needles: str) -> str:
    """The one error line of `err` (stderr of a run), asserted to hold every needle and to end the run."""
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and all(n in errors[0] for n in needles) and err.rstrip().endswith(errors[0]), err
    assert "Traceback" not in err, err
    return errors[0]
