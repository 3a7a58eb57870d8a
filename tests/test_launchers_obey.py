"""The launches tupe_ds starts itself (tupe_ds/distributed/launchers.py, for tupe-compare and make
demo) on the user's MASTER_ADDR and MASTER_PORT; a port they choose, taken by another process
before the run listens on it, chosen again; mpirun's default port checked on rank 0; DeepSpeed's
CPU fallback warning kept out of the deepspeed launcher's own output without DS_ACCELERATOR.

The launches start tests/support/rendezvous_probe.py, whose 2 ranks meet over gloo and print the
MASTER_ADDR and MASTER_PORT they met at."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from runs import ROOT, assert_quiet, environment
from logged import logged_lines
from tupe_ds.distributed import launch, launchers
from tupe_ds.tools import third_party_warnings

SUPPORT = os.path.join(ROOT, "tests", "support")


def probe_environment() -> dict:
    """The launcher's environment as a user's shell would give it: no MASTER_ADDR, MASTER_PORT
    or DS_ACCELERATOR unless a test sets them."""
    env = {name: value for name, value in environment().items()
           if name not in ("MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")}
    return {**env, "PYTHONPATH": f"{ROOT}:{SUPPORT}", "SLURMD_NODENAME": "none"}


def met_at(output: str) -> set:
    """{(address, port)} the probe's ranks met at; both ranks must have printed theirs (one JSON
    object each, at times on one line)."""
    lines = [json.loads(found) for found in re.findall(r'\{"launcher"[^{}]*\}', output)]
    assert sorted(line["rank"] for line in lines) == [0, 1], output[-3000:]
    return {tuple(line["master"]) for line in lines}


def test_a_users_master_address_and_port_are_the_launchers(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "23456")
    deepspeed = launchers.launcher_command("deepspeed", 2, "m", [])
    torchrun = launchers.launcher_command("torchrun", 2, "m", [])
    assert deepspeed[deepspeed.index("--master_port") + 1] == "23456"
    assert torchrun[torchrun.index("--master_port") + 1] == "23456"
    assert torchrun[torchrun.index("--master_addr") + 1] == "10.1.2.3"
    with socket.socket() as held:  # the user's port, taken: the launch fails on it, as asked
        held.bind(("", launchers.free_port()))
        held.listen()
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
        commands = []
        with logged_lines() as said:
            assert launchers.launch("torchrun", 2, "m", [], lambda c: commands.append(c) or 1) == 1
        assert not said  # the user's port: no other tried
        assert len(commands) == 1
    monkeypatch.delenv("MASTER_ADDR")
    monkeypatch.delenv("MASTER_PORT")
    torchrun = launchers.launcher_command("torchrun", 2, "m", [])
    assert "--master_addr" not in torchrun
    chosen = int(torchrun[torchrun.index("--master_port") + 1])
    assert launchers.FIRST_PORT <= chosen < launchers.ephemeral_ports()[0]


@pytest.mark.slow
def test_a_real_launch_meets_on_the_users_master_port_and_says_nothing(monkeypatch):
    """The deepspeed launcher as tupe-compare starts it, where the user set MASTER_PORT and no
    DS_ACCELERATOR: its ranks meet on that port, and neither it nor DeepSpeed warns."""
    port = launchers.free_port()
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    env = {**probe_environment(), "MASTER_PORT": str(port)}
    result = subprocess.run(launchers.launcher_command("deepspeed", 2, "rendezvous_probe", []),
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert met_at(result.stdout) == {("127.0.0.1", port)}
    assert_quiet(result.stdout + result.stderr)


@pytest.mark.slow
def test_a_chosen_port_taken_before_the_run_listens_is_chosen_again(monkeypatch):
    """The port chosen for torchrun taken by another process as it starts: its store fails to
    listen, and the launch is made again on another port."""
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    outputs, said = [], []
    with socket.socket() as taker:

        def run(command):
            if not outputs:  # the first launch's port, taken between the check and the launch
                taker.bind(("", int(command[command.index("--master_port") + 1])))
                taker.listen()
            result = subprocess.run(command, env=probe_environment(), capture_output=True,
                                    text=True, timeout=300)
            outputs.append(result.stdout + result.stderr)
            return result.returncode

        with logged_lines() as said:
            exit_code = launchers.launch("torchrun", 2, "rendezvous_probe", [], run)
        taken = taker.getsockname()[1]
    assert exit_code == 0, outputs[-1][-3000:]
    assert len(outputs) == 2 and "EADDRINUSE" in outputs[0] and f"port: {taken}" in outputs[0]
    assert said == [f"tupe_ds: port {taken} was taken by another process as the launch "
                    "started: launching again on another port"]
    (address, port), = met_at(outputs[1])
    assert address == "127.0.0.1" and port != taken


def test_the_deepspeed_launcher_is_told_the_cpu_only_where_deepspeed_would_choose_it_silently(
        monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv(third_party_warnings.VERBOSE, raising=False)
    monkeypatch.setattr(third_party_warnings, "nvidia_gpus_present", lambda: True)
    assert third_party_warnings.launcher_accelerator() is None  # GPUs CUDA missed: it says so
    monkeypatch.setattr(third_party_warnings, "nvidia_gpus_present", lambda: False)
    from deepspeed.accelerator import get_accelerator

    chosen = get_accelerator().device_name()
    assert third_party_warnings.launcher_accelerator() == ("cpu" if chosen == "cpu" else None)
    monkeypatch.setenv(third_party_warnings.VERBOSE, "1")
    assert third_party_warnings.launcher_accelerator() is None
    monkeypatch.setenv(third_party_warnings.VERBOSE, "")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # the user's: the launcher reads it itself
    assert third_party_warnings.launcher_accelerator() is None
    assert launchers.launcher_command("deepspeed", 2, "m", [])[0] == sys.executable


def test_mpiruns_default_port_taken_on_rank_0_is_a_clear_error(monkeypatch):
    with socket.socket() as held:
        held.bind(("", launchers.free_port()))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(launch, "DEFAULT_PORT", port)
        mpirun = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                  "MASTER_ADDR": "127.0.0.1"}
        with pytest.raises(RuntimeError, match=rf"^port {port}, the rendezvous port under mpirun "
                           r"when MASTER_PORT is unset, is in use .* Set MASTER_PORT to a free"):
            launch.discover({**mpirun, "OMPI_COMM_WORLD_RANK": "0"})
        other_rank = {**mpirun, "OMPI_COMM_WORLD_RANK": "1"}  # it dials the port, not holds it
        assert launch.discover(other_rank) == "mpirun" and other_rank["MASTER_PORT"] == str(port)
        users = {**mpirun, "OMPI_COMM_WORLD_RANK": "0", "MASTER_PORT": str(port)}
        assert launch.discover(users) == "mpirun"  # the user's own port, as it is
    free = {**mpirun, "OMPI_COMM_WORLD_RANK": "0"}
    assert launch.discover(free) == "mpirun" and free["MASTER_PORT"] == str(port)


@pytest.mark.parametrize("value", ["abc", "0", "99999", "-1"])
def test_a_master_port_that_is_no_port_is_said_before_any_launch(monkeypatch, value):
    monkeypatch.setenv("MASTER_PORT", value)
    with pytest.raises(ValueError, match=f"MASTER_PORT='{value}' is not a port"):
        launchers.launcher_command("torchrun", 2, "tupe_ds.pretrain", [])
    monkeypatch.setenv("MASTER_PORT", "")  # empty: unset, as before
    assert launchers.users_port() is None


@pytest.mark.parametrize("environ, said", [
    ({"RANK": ""}, "RANK='' in the environment (single process)"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' in the environment (a launcher"),
    ({"WORLD_SIZE": "0"}, "RANK=0 with WORLD_SIZE=0 in the environment"),
    ({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "RANK=3 with WORLD_SIZE=2"),
    ({"RANK": "\u00b2", "WORLD_SIZE": "4"}, "RANK='\u00b2' in the environment"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "--1"}, "LOCAL_RANK='--1' in the environment"),
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "RANK='x' in the environment (mpirun)"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "the launcher's variables in the environment are incomplete "
                                    "('OMPI_COMM_WORLD_SIZE')"),
])
def test_launcher_variables_that_are_no_ranks_are_one_line_for_every_command(
        environ, said, monkeypatch, capsys):
    """Left in a shell or a script (RANK= exported empty): refused, with what to unset, where a
    traceback (int(''), a division by WORLD_SIZE 0) ended every command."""
    from tupe_ds.tools import entry
    from tupe_ds.tools.errors import CommandRefused

    with pytest.raises(CommandRefused, match=f"^{re.escape(said)}.*unset"):
        launch.discover(dict(environ))
    assert launch.discover({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"})  # as some set it
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so that what discover() fills in is undone
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert entry.run("tupe-x", lambda: launch.discover() and 0) == 2
    assert capsys.readouterr().err.startswith(f"tupe-x: error: {said}")
