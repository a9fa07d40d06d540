"""The one error type users see: the CLI prints its message as a single line and exits non-zero."""


class UserError(Exception):
    """Bad input or an impossible request; the message names the file or tensor and what to do."""
