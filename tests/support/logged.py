"""The lines tupe_ds's loggers say in a block, as a list (what a command shows on its terminal)."""

import contextlib
import logging


@contextlib.contextmanager
def logged_lines():
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("tupe_ds")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
