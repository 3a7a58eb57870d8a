"""The locks of torch's extension builder, which DeepSpeed uses for its compiled ops: where they
are, which live process holds each, and what to tell a user about one that nobody holds (a build
killed midway leaves it, and every later run that loads the extension waits on it forever), and
the text of a wait during which DeepSpeed may build or load one (`waiting_with_extensions`)."""

import glob
import os
import time

STALE_LOCK_SECONDS = 300  # an extension build takes a minute or two
# Filesystems other machines mount too (their type in /proc/mounts): a build there may run on
# another node, where this machine's process table cannot see it.
SHARED_FILESYSTEMS = (
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "fhgfs",  # fhgfs: BeeGFS before 2014
    "ceph", "fuse.ceph-fuse", "fuse.ceph",  # CephFS: the kernel client, ceph-fuse (old: ceph)
    "dvs",  # Cray DVS, projecting a shared filesystem to compute nodes
    "wekafs", "gfs2", "ocfs2", "pvfs2",  # pvfs2: OrangeFS's kernel client
    "cifs", "smb3", "glusterfs", "fuse.glusterfs", "panfs", "9p", "fuse.sshfs",
    "fuse.juicefs", "fuse.quobyte", "fuse.mfs", "afs")  # mfs: MooseFS
# Filesystems of one machine's own disks or memory: a folder there is seen by no other node.
LOCAL_FILESYSTEMS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs",
                     "vfat", "exfat", "ntfs", "ntfs3", "fuseblk", "tmpfs", "ramfs", "overlay",
                     "squashfs")


def extensions_root(environ=os.environ) -> str:
    """Where torch builds DeepSpeed's extensions: TORCH_EXTENSIONS_DIR, else torch's cache."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return environ["TORCH_EXTENSIONS_DIR"]
    from torch.utils.cpp_extension import get_default_build_root

    return get_default_build_root()


def filesystem_type(path: str, mounts: str = "/proc/mounts") -> str:
    """The type of the filesystem `path` is on (the longest mount point above it), or ""."""
    path, best, kind = os.path.realpath(path), "", ""
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return ""
    return kind


def lock_holders(path: str) -> list:
    """PIDs of the processes on this machine with `path` open: torch's FileBaton keeps its lock
    file open from the start of a build to its end."""
    target, holders = os.path.realpath(path), []
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == target:
                holders.append(int(fd.split("/")[2]))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return sorted(set(holders))


def extension_locks(environ=os.environ) -> list:
    """(path, age in seconds, PIDs holding it, the filesystem's type if other machines mount it,
    else "") of every extension build lock: ROOT/NAME/lock, or ROOT/pyXY_ACCELERATOR/NAME/lock
    under torch's default root."""
    root = extensions_root(environ)
    found = []
    for path in sorted(glob.glob(os.path.join(root, "*", "lock")) +
                       glob.glob(os.path.join(root, "*", "*", "lock"))):
        try:
            age = time.time() - os.path.getmtime(path)
        except FileNotFoundError:  # the build ended meanwhile
            continue
        kind = filesystem_type(path)
        found.append((path, age, lock_holders(path), kind if kind in SHARED_FILESYSTEMS else ""))
    return found


def is_stale(age: float, holders: list, shared: str) -> bool:
    """Known to be left by a killed build: old, and no process holds it where every holder
    would show (not on a shared filesystem, where it may be another node's)."""
    return not holders and not shared and age > STALE_LOCK_SECONDS


def lock_text(path: str, age: float, holders: list, shared: str) -> str:
    if holders:
        return (f"{path}: process {', '.join(map(str, holders))} is building this DeepSpeed "
                "extension; runs that need it wait until it is done")
    if shared:
        state = (f"held by no process on this machine ({age / 60:.0f} minutes old), on a {shared} "
                 "filesystem, where a build on another node does not show from here (set "
                 "TORCH_EXTENSIONS_DIR to a node-local folder, as slurm/srun_requeue.sh does)")
    elif age > STALE_LOCK_SECONDS:
        state = (f"{age / 60:.0f} minutes old and held by no process on this machine: the lock "
                 "of a build that was killed")
    else:
        state = (f"held by no process on this machine ({age:.0f} s old): another machine "
                 "sharing this folder may be building")
    return (f"{path}: {state}; every run that loads this extension waits on it forever. "
            f"If no build is running, remove it: rm {path}")


def waiting_with_extensions(what: str):
    """A wait during which DeepSpeed may also build or load an extension: its text, with the
    state of every build lock at the time it is printed."""
    def text() -> str:
        locks = [lock_text(*lock) for lock in extension_locks()]
        return (f"{what} (DeepSpeed may be building an extension in {extensions_root()})"
                + "".join(f"; {lock}" for lock in locks))
    return text
