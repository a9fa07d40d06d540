"""The `quantizer` command: one sub-command per pipeline stage.

User errors (bad input, impossible targets) print one line and exit 2, and so do the file-system
errors a user fixes (a full disk, a read-only or forbidden location); a stage that finds faults
(verify, inspect) exits 1; nothing prints a traceback for something the user can fix. Ctrl-C (exit 130)
and SIGTERM (a scheduler's stop, or torchrun stopping the other ranks; exit 143) print one line and
stop the way an interrupt does: finished work is kept, and the same command resumes. That holds from
the first line of main(): until the command begins (imports of the sub-commands and torch, parsing),
nothing is written, and a handler prints the line and exits at once, raising nothing into the imports
(torch's C module clears an exception raised while it imports numpy, so a KeyboardInterrupt there was
lost, or left numpy half-imported: issue 60). Before main() runs, Python's start-up has it: the process
dies by the signal with nothing printed until Python has set its own handler, and after that (its site
module, the import of this module: a few tens of ms) Python prints its KeyboardInterrupt report.
"""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import os
import signal
import sys
import threading

from quantizer import __version__
from quantizer.errors import UserError

# What the user does about each file-system error that is theirs to fix, not a bug of ours.
OS_ERRORS = {
    errno.ENOSPC: "no space left on the device; free some space and rerun the same command (finished work is kept)",
    errno.EDQUOT: "disk quota exceeded; free some space and rerun the same command (finished work is kept)",
    errno.EROFS: "the file system is read-only; choose a writable location",
    errno.EACCES: "permission denied; choose a location you can write to",
    errno.EPERM: "operation not permitted; choose a location you can write to",
}

# Each module defines register(subparsers), which adds its sub-command with func=run.
COMMANDS = (
    "quantizer.commands.inventory",
    "quantizer.commands.make_tiny",
    "quantizer.commands.calibrate",
    "quantizer.commands.ppl",
    "quantizer.commands.plan",
    "quantizer.commands.fit",
    "quantizer.commands.build",
    "quantizer.commands.verify",
    "quantizer.commands.card",
    "quantizer.commands.publish",
    "quantizer.commands.evaluate",
    "quantizer.commands.demo",
)

STOPS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and a scheduler's or torchrun's stop


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantizer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"quantizer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        importlib.import_module(module).register(sub)
    for command in sub.choices.values():
        command.set_defaults(parser=command)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, except that an argument the command does not take is refused with that command's usage:
    argparse leaves a sub-command's leftovers to the top parser, whose usage names no command's flags."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so it unwinds (locks released, partial files removed) as
    Ctrl-C does."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def _say(line: str) -> None:
    """One write per line: torchrun ranks share one stderr, and print() writes the text and its newline
    separately, so two ranks' lines could run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    who = f"quantizer{' ' + command if command else ''}"
    # The handlers to restore on return (only the main thread may set one; None: not set from Python).
    found = {s: signal.getsignal(s) for s in STOPS} if threading.current_thread() is threading.main_thread() else {}
    found = {s: handler for s, handler in found.items() if handler is not None}
    for s, handler in found.items():
        if handler is not signal.SIG_IGN:  # an ignored Ctrl-C (a background job's) stays ignored
            signal.signal(s, functools.partial(_stop_at_once, who))
    try:
        return _main(argv, found)
    except KeyboardInterrupt as e:  # once the command had ended
        return _interrupted(e, who)
    finally:
        for s, handler in found.items():
            signal.signal(s, handler)


def _stop_at_once(who: str, signum: int, frame) -> None:
    """Ctrl-C or SIGTERM before the command began: nothing is written yet, so print the line and exit here.
    os.write, not sys.stderr: the interrupted code may be inside a write to sys.stderr, which is not reentrant."""
    os.write(2, (_interrupted_line(who, signum == signal.SIGTERM) + "\n").encode())
    os._exit(128 + signum)


def _interrupted_line(who: str, terminated: bool) -> str:
    return f"{who}: interrupted{' by SIGTERM' if terminated else ''}; rerun the same command to resume"


def _interrupted(e: KeyboardInterrupt, who: str) -> int:
    terminated = isinstance(e, Terminated)
    _say(_interrupted_line(who, terminated))
    return 128 + (signal.SIGTERM if terminated else signal.SIGINT)


def _main(argv: list[str], found: dict) -> int:
    """`found`: the handlers main() found; as the command begins, Ctrl-C gets its own back and SIGTERM gets
    _terminate, so that both raise where the command is and it unwinds."""
    from quantizer.distributed import join_from_env, leave

    try:
        parser = build_parser()  # reads the loader profiles (--loader's help): a faulty one of $QUANTIZER_LOADERS
    except UserError as e:
        _say(f"quantizer: error: {e}")
        return 2
    args = parse(parser, argv)
    args.argv = argv  # the command as given (build records it in the pack's card)
    ranks = join_from_env()  # under torchrun: this process's rank of the job
    who = f" (rank {ranks.rank} of {ranks.world})" if ranks.joined else ""
    if signal.SIGINT in found:
        signal.signal(signal.SIGINT, found[signal.SIGINT])
    if signal.SIGTERM in found:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except UserError as e:
        _say(f"quantizer {args.command}{who}: error: {e}")
        return 2
    except OSError as e:
        if e.errno not in OS_ERRORS:
            raise
        _say(f"quantizer {args.command}{who}: error: {e.filename or 'writing'}: {OS_ERRORS[e.errno]}")
        return 2
    except KeyboardInterrupt as e:
        return _interrupted(e, f"quantizer {args.command}{who}")
    finally:
        leave()


if __name__ == "__main__":
    sys.exit(main())
