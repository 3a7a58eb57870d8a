"""Batches made by a background thread while the accelerator works on the ones before.

The thread runs the same generator the training loop would, in the same order, at most `depth`
items ahead; numpy does the heavy part of each batch with the GIL released. Tensors come out
pinned when they are bound for an accelerator, so the step's copies do not block the host (not
measured on a GPU yet).
(DataLoader workers would copy every batch between processes and need the stream's position
handed over at each resume; one thread needs neither.)
"""

import contextlib
import queue
import threading
from typing import Iterator

import torch

_END = object()


class _Failed:  # the producer's error (an item itself may be an exception object)
    def __init__(self, error: BaseException):
        self.error = error


def pinned(item):
    """`item` (a tensor, or dicts/lists of them) in pinned host memory."""
    if isinstance(item, torch.Tensor):
        return item.pin_memory()
    if isinstance(item, dict):
        return {key: pinned(value) for key, value in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(pinned(value) for value in item)
    return item


class Prefetched:
    """Iterates over `items`, which a daemon thread produces up to `depth` ahead."""

    def __init__(self, items: Iterator, depth: int, pin: bool):
        self.queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._produce, args=(items, pin), daemon=True,
                                       name="tupe-prefetch")
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, items: Iterator, pin: bool) -> None:
        try:
            for item in items:
                if not self._put(pinned(item) if pin else item):
                    return
            self._put(_END)
        except BaseException as error:  # raised again in the consumer, with its traceback
            self._put(_Failed(error))

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get()
        if item is _END or isinstance(item, _Failed):
            self.queue.put(item)  # the producer has stopped: a later call ends the same way
            raise StopIteration if item is _END else item.error
        return item

    def close(self) -> None:
        """Stops the thread (what it made ahead is dropped)."""
        self.stopping.set()
        self.thread.join()


def made_ahead(items: Iterator, depth: int, pin: bool):
    """`items` made by a Prefetched thread while the block runs (as they are if depth is 0)."""
    if depth == 0:
        return contextlib.nullcontext(items)
    return contextlib.closing(Prefetched(items, depth, pin))
