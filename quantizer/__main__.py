"""`python -m quantizer ...` runs the `quantizer` command (for a venv without its scripts on PATH)."""

import sys

from quantizer.cli import main

sys.exit(main())
