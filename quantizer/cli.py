"""The `quantizer` command: one sub-command per pipeline stage.

User errors (bad input, impossible targets) print one line and exit 2, and so do the file-system
errors a user fixes (a full disk, a read-only or forbidden location); a stage that finds faults
(verify, inspect) exits 1; nothing prints a traceback for something the user can fix. Ctrl-C (exit 130)
and SIGTERM (a scheduler's stop, or torchrun stopping the other ranks; exit 143) print one line and
stop the way an interrupt does: finished work is kept, and the same command resumes. That holds from
the first moment: this module imports nothing heavy, and the sub-commands (and torch, a second to
import) are imported inside main(), so a Ctrl-C while they load is the same one line.
"""

from __future__ import annotations

import argparse
import errno
import importlib
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
    try:
        return _main(argv)
    except KeyboardInterrupt as e:  # before the command began (its imports) or once it had ended
        command = next((a for a in argv if not a.startswith("-")), None)
        return _interrupted(e, f"quantizer{' ' + command if command else ''}")


def _interrupted(e: KeyboardInterrupt, who: str) -> int:
    how = " by SIGTERM" if isinstance(e, Terminated) else ""
    _say(f"{who}: interrupted{how}; rerun the same command to resume")
    return 128 + signal.SIGTERM if how else 130


def _main(argv: list[str]) -> int:
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
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set a handler
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
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
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        leave()


if __name__ == "__main__":
    sys.exit(main())
