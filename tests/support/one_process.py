"""A fixture for tests that build DeepSpeed engines in the test process: import it by name into
the test module (`from one_process import deepspeed_group  # noqa: F401`)."""

import pytest
import torch


@pytest.fixture(scope="module")
def deepspeed_group():
    """DeepSpeed over a one-process gloo group (megatron-core's state at tp 1), destroyed at the
    end if this module started it."""
    import deepspeed  # before the group exists: see end_distributed

    from tupe_ds.distributed.parallel import (end_distributed, ensure_model_parallel,
                                              start_distributed)

    started = not torch.distributed.is_initialized()
    ensure_model_parallel(1)
    start_distributed("gloo")
    yield deepspeed
    if started:
        end_distributed()
