"""tupe_ds.tools.third_party_warnings: the commands start without megatron-core's import
warnings, show them with --verbose or TUPE_DS_VERBOSE=1, and a warning that no filter names still shows."""

import logging
import os
import subprocess
import sys
import warnings

import pytest

from runs import environment
from tupe_ds.tools import third_party_warnings

BIN = os.path.dirname(sys.executable)


def help_stderr(command: str, *flags, **env) -> str:
    result = subprocess.run([os.path.join(BIN, command), "--help", *flags],
                            env={**environment(), **env}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr


@pytest.mark.parametrize("command, flag, variable", [("tupe-pretrain", "--verbose", ""),
                                                     ("tupe-prep", "--help", "1")])
@pytest.mark.slow
def test_commands_start_quietly_and_verbose_shows_everything(command, flag, variable):
    """Each command quiet, then verbose one way: --verbose, or TUPE_DS_VERBOSE=1 (both go
    through add_verbose_flag and quiet(), the same for every command)."""
    assert "Apex" not in help_stderr(command, TUPE_DS_VERBOSE="")
    assert "Apex" in help_stderr(command, flag, TUPE_DS_VERBOSE=variable)  # megatron-core's


def warned(message: str, module: str) -> bool:
    """Whether a warning attributed to `module` gets through the filters."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        third_party_warnings.quiet()
        warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
    return bool(caught)


def test_only_the_named_warnings_are_filtered(monkeypatch):
    monkeypatch.setenv(third_party_warnings.VERBOSE, "")
    monkeypatch.setattr(sys, "argv", ["tupe-pretrain"])
    assert not warned("Apex is not installed. Falling back to Torch Norm", "megatron.core.models")
    assert warned("Apex is not installed. Falling back to Torch Norm", "mypackage")
    assert warned("Something that matters", "megatron.core.models")
    monkeypatch.setenv(third_party_warnings.VERBOSE, "1")
    assert warned("Apex is not installed. Falling back to Torch Norm", "megatron.core.models")


def test_filtered_log_records(monkeypatch, caplog):
    monkeypatch.setenv(third_party_warnings.VERBOSE, "")
    logger = logging.getLogger("torch.fx._symbolic_trace")
    before = list(logger.filters)
    try:
        third_party_warnings.quiet()
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("is_fx_tracing will return true for both fx.symbolic_trace and ...")
            logger.warning("a tracing problem that matters")
        assert [r.getMessage() for r in caplog.records] == ["a tracing problem that matters"]
    finally:
        logger.filters[:] = before
    assert all(quieted.why for quieted in third_party_warnings.QUIETED)
