"""The Hugging Face Hub where quantizer meets it: names checked where they enter, failures as one line.

A repository id is judged by huggingface_hub's own validator (`utils.validate_repo_id`: letters,
digits, '-', '_', '.', no '--' or '..', no part starting or ending in '-' or '.', 96 characters at
most). huggingface_hub has no validator for a branch name and leaves it to the server, which follows
git's rules (git-check-ref-format(1)): `branch_problem` applies those, so a name the hub would refuse
is refused before anything is verified or uploaded. Inside `hub_failures(what)`, what huggingface_hub
(or a library that calls it, such as `datasets`) raises when the hub cannot be reached, is switched off
(HF_HUB_OFFLINE), or refuses a request becomes one line that says what to do.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

from quantizer.errors import UserError

LOGIN = "log in with `hf auth login` or set HF_TOKEN"
# git-check-ref-format(1): no component starting with '.' or ending in '.lock', no '..', no control
# character, space, ~ ^ : ? * [ or backslash, no leading, trailing or doubled '/', no trailing '.', no '@{'.
_BAD_BRANCH = re.compile(r"(^|/)\.|\.lock(/|$)|\.\.|[\x00-\x20\x7f~^:?*\[\\]|^/|/$|//|\.$|@\{")


def repo_id_problem(text: str) -> str | None:
    """Why `text` is not a Hugging Face repository id owner/name (None: it is one)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    rules = ("a repository id is owner/name of letters, digits, '-', '_' and '.', with no '--' or '..' and no part "
             "starting or ending in '-' or '.' (huggingface_hub's rules)")
    if text.count("/") != 1:
        return rules
    try:
        validate_repo_id(text)
    except HFValidationError:
        return rules
    return None


def branch_problem(text: str) -> str | None:
    """Why `text` is not a branch name the hub accepts (None: it is one)."""
    if not text or text == "@" or _BAD_BRANCH.search(text):
        return ("a branch name is not empty and has no '..', space, control character, ~ ^ : ? * [ or backslash, "
                "no part starting with '.' or ending in '.lock', no leading, trailing or doubled '/' (git's rules)")
    return None


@contextmanager
def hub_failures(what: str) -> Iterator[None]:
    """Run the body; a failure of the hub (or of the way to it) while doing `what` ("upload to ORG/NAME")
    becomes one UserError line, anything else keeps its type."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a hub failure becomes one line; anything else is re-raised
        refusal = hub_refusal(e, what)
        if refusal is None:
            raise
        raise refusal from None


def hub_refusal(e: BaseException, what: str) -> UserError | None:
    """One line for a failure of the hub (or of the way to it) while doing `what` ("upload to ORG/NAME"),
    named by `e` or by the error behind it (libraries such as `datasets` re-raise the hub's errors as
    their own); None when `e` is not such a failure."""
    from huggingface_hub import constants, errors

    chain = list(_chain(e))
    offline = UserError(f"{what}: huggingface_hub is in offline mode (HF_HUB_OFFLINE is set); unset HF_HUB_OFFLINE "
                        "(and HF_DATASETS_OFFLINE) and rerun")
    for cause in chain:
        if isinstance(cause, errors.OfflineModeIsEnabled):
            return offline
        if isinstance(cause, errors.LocalEntryNotFoundError):
            return UserError(f"{what}: not in the local Hugging Face cache and the hub cannot be reached (no "
                             "connection, or HF_HUB_OFFLINE set); check the network, or download it first")
        if isinstance(cause, errors.HfHubHTTPError):
            return _http_refusal(cause, what)
        if isinstance(cause, errors.HFValidationError):
            return UserError(f"{what}: huggingface_hub refuses it ({_first_line(cause)})")
    network = tuple(c for c in (getattr(errors, "HTTPError", None),) if c) + (ConnectionError, TimeoutError)
    for cause in chain:
        if isinstance(cause, network) and constants.HF_HUB_OFFLINE:  # `datasets` keeps only the name of the refusal
            return offline
        if isinstance(cause, network):
            return UserError(f"{what}: cannot reach the Hugging Face Hub ({type(cause).__name__}: {_first_line(cause)}); "
                             "check the network connection and proxy settings (HTTPS_PROXY), then rerun")
    return None


def _http_refusal(e, what: str) -> UserError:
    status = getattr(getattr(e, "response", None), "status_code", None)
    said = (getattr(e, "server_message", None) or "").strip().splitlines()
    detail = f"HTTP {status}" + (f": {said[0]}" if said else "")
    if status in (401, 403):
        return UserError(f"{what}: the hub refused it ({detail}); {LOGIN} with a token that has access (publishing "
                         "needs write access)")
    if status is not None and 400 <= status < 500:
        return UserError(f"{what}: the hub rejected the request ({detail}); check the repository id and branch name")
    return UserError(f"{what}: the hub failed ({detail}); try again later (a rerun resumes)")


def _chain(e: BaseException):
    """`e`, then what caused it, and so on (libraries re-raise the hub's errors as their own)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"
