"""The settings a run recorded (its history's last start, OUT/history.jsonl; before the history,
OUT/run.json): `tupe-pretrain --out RUN` alone (or with a new --steps) goes on with them, as
Megatron-LM's --use-checkpoint-args does. They fill every setting the command (its flags and
--config file) does not give, whether or not it gives what a run needs: a flag or a --config file wins over them, and what then differs from the checkpoint goes
through the same-run checks of any resume (checkpoint/allowed_changes.py). The start says both:
the run's settings taken, and those given anew that differ from the run's (`say_taken`)."""

import argparse
import json
import os
import sys
from typing import Optional

from tupe_ds.data.sources import named_folder
from tupe_ds.train import run_description
from tupe_ds.train.checkpoint import history

FIELD = "settings"  # of run.json: {dest: value}
# What one command asks once, not what the run is: never recorded, never taken from run.json.
ONE_SHOT = ("check_only", "print_config", "fresh_start", "giving_up", "resume", "resume_from",
            "allow_training_changes", "config", "local_rank", "verbose")
PATHS = ("ds_config", "index_cache", "init_from", "out")  # recorded absolute


def recordable(args: argparse.Namespace) -> dict:
    """The command's settings as run.json records them: all but the one-shot ones, paths
    absolute (a resume may start in another folder)."""
    settings = {dest: value for dest, value in vars(args).items() if dest not in ONE_SHOT}
    for dest in PATHS:
        if settings.get(dest):  # not "", which unsets --init-from
            settings[dest] = os.path.abspath(settings[dest])
    blended = len(args.data) > 1  # weight, folder, weight, folder...
    settings["data"] = [item if blended and index % 2 == 0 else absolute_data(item)
                        for index, item in enumerate(args.data)]
    return settings


def absolute_data(item: str) -> str:
    """A folder of --data made absolute, NAME=FOLDER named still."""
    name, folder = named_folder(item)
    return f"{name}={os.path.abspath(folder)}" if folder != item else os.path.abspath(item)


def of_run_folder(args: argparse.Namespace, quiet: bool = False) -> Optional[tuple]:
    """(where, {dest: value}) of the settings the run's last start recorded in its history
    (OUT/history.jsonl; for a run from before the history, OUT/run.json), for
    command_line.parse; None when there are none (a new run, or a record that does not read:
    the command alone then says what the run is, and unless `quiet`, so does a line on stderr)."""
    if not args.out:
        return None
    try:
        found = history.recorded_settings(history.read(args.out) or [])
    except history.HistoryDamaged as error:
        if not quiet:
            print(f"tupe-pretrain: the run's settings cannot be taken from it: {error}",
                  file=sys.stderr)
        return None
    if found is not None:
        return (os.path.join(args.out, history.FILE),
                {dest: value for dest, value in found[0].items() if dest not in ONE_SHOT})
    try:
        settings = run_description.read(args.out).get(FIELD)
    except ValueError as error:
        if not quiet and os.path.exists(os.path.join(args.out, run_description.FILE)):
            print(f"tupe-pretrain: its settings cannot be taken from it: {error}",
                  file=sys.stderr)
        return None
    if not isinstance(settings, dict):
        if not quiet:
            print(f"tupe-pretrain: {os.path.join(args.out, run_description.FILE)} records no "
                  "settings (an earlier tupe_ds wrote it): give the run's flags", file=sys.stderr)
        return None
    return (os.path.join(args.out, run_description.FILE),
            {dest: value for dest, value in settings.items() if dest not in ONE_SHOT})


def say_taken(args: argparse.Namespace, sources: dict, defaults: dict) -> None:
    """One line when the run recorded settings: those taken from it that are not the defaults,
    and those the command gives anew that differ from what it recorded (old -> new), so that a
    resume changes no setting unseen."""
    recorded = of_run_folder(args, quiet=True)  # said once already, by the parse
    if recorded is None:
        return
    where, settings = recorded
    taken = [dest for dest, source in sources.items() if source == where]
    named = [flag(dest) for dest in taken if getattr(args, dest) != defaults.get(dest)]
    now = json.loads(json.dumps(recordable(args)))  # as run.json holds it: lists, paths absolute
    changed = [f"{flag(dest)} {shown(settings[dest])} -> {shown(now[dest])}"
               for dest, source in sources.items()
               if source != where and dest in settings and dest in now
               and settings[dest] != now[dest] and dest != "out"]  # a run folder moved
    parts = []
    if taken:
        parts.append(f"the settings the command does not give are the run's, from {where}: "
                     f"{', '.join(named) or 'the defaults'}")
    if changed:
        parts.append(f"given anew, other than the run's: {', '.join(changed)}")
    if parts:
        print(f"tupe-pretrain: {'; '.join(parts)} (--print-config shows them)", flush=True)


def flag(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def shown(value) -> str:
    """A recorded value as a command line would give it."""
    if value is None:
        return "(unset)"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)
