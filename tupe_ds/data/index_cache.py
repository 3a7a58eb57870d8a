"""Arrays computed once per input and kept as .npy files that every process memory-maps.

An array is named by a digest of its key (what it was computed from: the input's content digest,
the rule, its parameters), so a changed input or rule names another file and an old file is
never read for it. A process that finds the array there maps it without any lock. The first
process to need it builds it under an exclusive lock on the cache folder's filesystem while the
others wait on the lock: `flock`, or where the filesystem has none (Lustre mounted without
`-o flock`), a lock file that names its holder and is taken over once that holder is gone
(tupe_ds/tools/lock.py). A training run does not rely on the lock alone (NFS with local_lock,
BeeGFS and Lustre's localflock lock per node): its rank 0 builds while the other ranks wait at a
barrier (tupe_ds/train/datasets.py). An array is written to a temporary file named by host and
process and linked into place, the first copy staying where two nodes built at once, so a build
that is killed leaves nothing that is read; the next builder on that host removes the remains of
builders that are no longer running there, and never touches another host's.
"""

import errno
import glob
import hashlib
import json
import os
from typing import Callable, Tuple

import numpy as np

from tupe_ds.tools.files import locked, temporary_name


def content_digest(*arrays: np.ndarray) -> str:
    """sha256 over the arrays' dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return digest.hexdigest()


def cached_path(folder: str, name: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(folder, f"{name}.{digest}.npy")


LOCK_FIX = ("point --index-cache at a folder on a filesystem that can (a local disk is enough: "
            "each node then builds its own copy)")


def publish_npy(path: str, array: np.ndarray) -> bool:
    """Write `array` to a temporary file, then link it to `path` unless another builder (on a
    node whose lock this one could not see) placed its copy first: the first copy stays, every
    process maps that one file, and no one's open file is replaced. Whether this one's stayed.
    On a filesystem without hard links, the temporary file is renamed into place instead."""
    temporary = temporary_name(path)
    with open(temporary, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(temporary, path)
    except FileExistsError:
        os.remove(temporary)
        return False
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        os.replace(temporary, path)
        return True
    os.remove(temporary)
    return True


def remove_remains(path: str) -> None:
    """The temporary files of builds of `path` that were killed on this host: those of processes
    no longer running here. Another host's are left alone (its builder may still be writing)."""
    prefix = temporary_name(path, pid=0)[:-1]
    for remains in glob.glob(glob.escape(prefix) + "*"):
        pid = remains[len(prefix):]
        if pid.isdigit() and not process_is_running(int(pid)):
            os.remove(remains)


def process_is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def cached_array(folder: str, name: str, key: dict,
                 build: Callable[[], np.ndarray]) -> Tuple[np.ndarray, str, bool]:
    """(the array memory-mapped read-only, its file, whether this process built it)."""
    path = cached_path(folder, name, key)
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        with locked(path[:-len(".npy")] + ".lock", LOCK_FIX):
            if not os.path.exists(path):  # else another process built it while this one waited
                remove_remains(path)
                built = publish_npy(path, build())
                return np.load(path, mmap_mode="r"), path, built
    return np.load(path, mmap_mode="r"), path, False
