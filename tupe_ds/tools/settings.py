"""Settings read from the environment (TUPE_DS_*), each declared once in ENVIRONMENT: a value that
is no setting is named in one line and the default used, so that no command fails for it at
import or in the middle of a run; `--print-config` shows each with the value used and where it
came from (`used`)."""

import logging
import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

_named = set()  # (name, value) already said: a setting read at every use is said once

ON, OFF = ("on", "1", "true", "yes"), ("", "off", "0", "false", "no")


@dataclass(frozen=True)
class Setting:
    what: str
    default: Optional[float] = None  # seconds; None: a switch, off unless set on
    least: float = 0.0
    flag: Optional[str] = None  # a command's flag that exports it (--verbose)


ENVIRONMENT = {
    "TUPE_DS_READ_RETRY_SECONDS": Setting("how long a read that fails is retried", 120.0),
    "TUPE_DS_LOCK_LEASE_SECONDS": Setting("a run folder's lock unrenewed this long is gone",
                                          600.0, least=10),
    "TUPE_DS_WAIT_NOTICE": Setting("a wait says what it waits for after this long", 30.0,
                                   least=0.01),
    "TUPE_DS_PROGRESS_SECONDS": Setting("a progress line where no terminal shows a bar", 60.0),
    "TUPE_DS_VERBOSE": Setting("the third-party warnings tupe_ds filters shown",
                               flag="--verbose"),
    "TUPE_DS_GC": Setting("the garbage collector left on while the libraries import"),
    "TUPE_DS_COMPILE_AT_IMPORT": Setting("the libraries' functions compiled as they import"),
}


def _say_once(name: str, value: str, problem: str) -> None:
    if (name, value) not in _named:
        _named.add((name, value))
        logger.warning(f"{name}={value!r}: {problem}")


def switched_on(name: str) -> bool:
    """Whether switch `name` is on (1, true, yes; any case); off when it is unset, off (0, false,
    no) or no such word (said once)."""
    return _read(name)[0]


def seconds(name: str) -> float:
    """Setting `name` in seconds, its least or more; its default when it is unset or no such
    number (said once)."""
    return _read(name)[0]


def _read(name: str) -> tuple:
    """(the value of setting `name` used, whether the environment gives a valid one)."""
    setting, given = ENVIRONMENT[name], os.environ.get(name)
    if setting.default is None:  # a switch
        word = (given or "").strip().lower()
        if word not in ON + OFF:
            _say_once(name, given.strip(), "neither on (1, true, yes) nor off (0, false, no); "
                                           "off used")
        return word in ON, given is not None and word in ON + OFF
    try:
        number = float(given)
    except (TypeError, ValueError):  # TypeError: unset
        number = math.nan
    if not math.isfinite(number) or number < setting.least:
        if given is not None:
            _say_once(name, given, f"not a number of seconds of {setting.least:g} or more; "
                                   f"{setting.default:g} used")
        return setting.default, False
    return min(number, threading.TIMEOUT_MAX), True  # a wait longer is forever


def used() -> list:
    """(name, the value used, where it came from, what it sets) of each setting."""
    lines = []
    for name, setting in ENVIRONMENT.items():
        given = os.environ.get(name)
        value, valid = _read(name)
        where = "environment" if valid else "default" if given is None else \
            f"default, the environment's {given!r} being no value of it"
        if setting.flag in sys.argv[1:]:
            where = f"command line ({setting.flag})"
        lines.append((name, value, where, setting.what))
    return lines
