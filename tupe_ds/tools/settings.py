"""Settings read from the environment (TUPE_DS_*): a value that is no setting is named in one
line and the default used, so that no command fails for it at import or in the middle of a run."""

import logging
import math
import os
import threading

logger = logging.getLogger(__name__)

_named = set()  # (name, value) already said: a setting read at every use is said once


ON, OFF = ("on", "1", "true", "yes"), ("", "off", "0", "false", "no")


def switched_on(name: str) -> bool:
    """Whether the environment variable `name` is on (1, true, yes; any case); off when it is
    unset, off (0, false, no) or no such word (said once)."""
    value = os.environ.get(name, "").strip()
    if value.lower() not in ON + OFF and (name, value) not in _named:
        _named.add((name, value))
        logger.warning(f"{name}={value!r}: neither on (1, true, yes) nor off (0, false, no); "
                       f"off used")
    return value.lower() in ON


def seconds(name: str, default: float, least: float) -> float:
    """The environment variable `name` as seconds, `least` or more; `default` when it is unset
    or no such number (said once)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if math.isfinite(number) and number >= least:
        return min(number, threading.TIMEOUT_MAX)  # a wait longer is forever
    if (name, value) not in _named:
        _named.add((name, value))
        logger.warning(f"{name}={value!r}: not a number of seconds of {least:g} or more; "
                       f"{default:g} used")
    return default
