"""A command run on a pseudo-terminal of a given width, as a person at a terminal runs it: what
the terminal receives (lines end in \r\n, bars redraw with \r)."""

import fcntl
import os
import select
import struct
import subprocess
import termios


def on_a_terminal(command: list, columns: int, env: dict = None, cwd: str = None,
                  stdout_too: bool = True, timeout: float = 400) -> str:
    """What `command` writes to a terminal `columns` wide (COLUMNS unset: the terminal says):
    its stderr, and its stdout unless `stdout_too` is False (then thrown away); AssertionError
    with it when the command fails or stays silent for `timeout` seconds."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {name: value for name, value in (env or os.environ).items()
           if name not in ("COLUMNS", "LINES")}
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                               stdout=slave if stdout_too else subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    received = bytearray()
    while select.select([master], [], [], timeout)[0]:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: every process holding the terminal has ended
            break
        if not chunk:
            break
        received += chunk
    os.close(master)
    said = received.decode("utf-8", errors="replace")
    try:
        assert process.wait(timeout=timeout) == 0, said[-4000:]
    finally:
        process.kill()  # if it hung: a no-op once it has exited
    return said
