"""What waits for the device in a step, counted on the CPU: `get_accelerator().synchronize()`
calls and host reads of tensor values (`Tensor.item`, `__bool__`, `__float__`, `__int__`,
`tolist`, `cpu`, `numpy`, `nonzero`; not boolean-mask indexing), each with the first frame
outside torch that made it (`path:function`, the path from the repository root or
site-packages).

On a CPU every tensor is in host memory. Reads of tensors that are in host memory on a GPU too
are told apart by type: HostValue, a tensor subclass that every tensor made from one inherits
(the loader's host copy of a batch, which a caller tags; the host values the foreach optimizer
boundary hands DeepSpeed, tagged by `host_values`)."""

import os
import sys
import threading
from dataclasses import dataclass

import torch

from tupe_ds.train import optimizer_boundary

READS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy", "nonzero")
TORCH = os.path.dirname(torch.__file__)
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


class HostValue(torch.Tensor):
    """A tensor in host memory by construction (see the module docstring)."""


@dataclass(frozen=True)
class Read:
    what: str  # a name of READS, or "synchronize"
    where: str  # path:function of the first frame outside torch
    host_value: bool  # a HostValue: host memory on a GPU too
    phase: str  # what the caller was doing (Counter.phase)


def caller() -> str:
    frame = sys._getframe(2)
    while frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == HERE:
        frame = frame.f_back
    path = frame.f_code.co_filename
    path = path.split("site-packages" + os.sep, 1)[-1] if "site-packages" in path \
        else os.path.relpath(path, ROOT)
    return f"{path}:{frame.f_code.co_name}"


class Counter:
    """Records every read and synchronisation in this process while installed (`install`);
    `phase` labels the ones that follow."""

    def __init__(self):
        self.reads, self.phase = [], ""
        # a read made by a read (a subclass's dispatch) counts once
        self._inside = threading.local()

    def _record(self, what: str, host_value: bool) -> None:
        self.reads.append(Read(what, caller(), host_value, self.phase))

    def _reading(self, name: str, original):
        counter = self

        def read(tensor, *args, **kwargs):
            if getattr(counter._inside, "depth", 0):
                return original(tensor, *args, **kwargs)
            counter._inside.depth = 1
            try:
                counter._record(name, isinstance(tensor, HostValue))
                return original(tensor, *args, **kwargs)
            finally:
                counter._inside.depth = 0
        return read

    def install(self, monkeypatch) -> "Counter":
        from deepspeed.accelerator import get_accelerator

        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._reading(name, original))
        synchronize = type(get_accelerator()).synchronize

        def counted_synchronize(accelerator, *args, **kwargs):
            self._record("synchronize", False)
            return synchronize(accelerator, *args, **kwargs)
        monkeypatch.setattr(type(get_accelerator()), "synchronize", counted_synchronize)
        return self

    def take(self) -> list:
        """The reads recorded since the last take."""
        reads, self.reads = self.reads, []
        return reads


def host_values(monkeypatch) -> None:
    """The foreach boundary's host norms as HostValue."""
    made = optimizer_boundary.host_norm
    monkeypatch.setattr(optimizer_boundary, "host_norm",
                        lambda value: made(value).as_subclass(HostValue))


def waits(reads) -> list:
    """The reads that would wait for a GPU: synchronisations, and reads of tensors that are not
    HostValues."""
    return [read for read in reads if read.what == "synchronize" or not read.host_value]
