"""The settings a run recorded (OUT/history.jsonl, its last start): they fill every one the
command (flags, --config file) does not give, as Megatron-LM's --use-checkpoint-args does."""

import argparse
import json
import logging
import os

from tupe_ds.data.sources import named_folder
from tupe_ds.train.checkpoint import folder, history
from tupe_ds.train.run_folder import description as folder_description

logger = logging.getLogger(__name__)

# What one command asks once, not what the run is: never recorded, never taken from the history.
ONE_SHOT = ("check_only", "print_config", "fresh_start", "giving_up", "resume", "resume_from",
            "allow_training_changes", "config", "local_rank", "verbose")
PATHS = ("ds_config", "index_cache", "init_from", "out")  # recorded absolute


def recordable(args: argparse.Namespace) -> dict:
    """The command's settings as the history records them: all but the one-shot ones, paths
    absolute (a resume may start in another folder), NAME=FOLDER of --data named still."""
    settings = {dest: value for dest, value in vars(args).items() if dest not in ONE_SHOT}
    for dest in PATHS:
        if settings.get(dest):  # not "", which unsets --init-from
            settings[dest] = os.path.abspath(settings[dest])
    settings["data"] = [  # blended: weight, folder, weight, folder...
        item if len(args.data) > 1 and index % 2 == 0
        else item.removesuffix(folder := named_folder(item)[1]) + os.path.abspath(folder)
        for index, item in enumerate(args.data)]
    return settings


def of_run_folder(args: argparse.Namespace, quiet: bool = False) -> tuple | None:
    """(where, {dest: value}) of the settings the run recorded: its history's last start, else
    (a history lost) its newest checkpoint's manifest; None for a new run or a
    damaged history (then said unless `quiet`)."""
    if not args.out:
        return None
    try:
        settings = history.recorded_settings(history.read(args.out) or [])
    except history.HistoryDamaged as error:
        if not quiet:
            logger.warning(f"tupe-pretrain: the run's settings cannot be taken from it: {error}")
        return None
    where = os.path.join(args.out, history.FILE)
    if settings is None:
        directory = os.path.join(args.out, "checkpoints")
        step, newest = max(folder.survey(directory)[0].items(), default=(0, {}))
        where = os.path.join(directory, folder.tag_of(step), "manifest.json")
        settings = newest.get("settings")
    if isinstance(settings, dict):
        return where, {k: v for k, v in settings.items() if k not in ONE_SHOT}
    if not quiet and "settings" in folder_description.recorded(args.out):
        logger.warning(f"tupe-pretrain: {os.path.join(args.out, folder_description.FILE)} holds "
                       "the settings of a run of a tupe_ds before 2026-11-29, which this one does "
                       "not read: give the run's flags, or resume it with that version")
    return None


def say_taken(args: argparse.Namespace, sources: dict, defaults: dict) -> None:
    """One line when the run recorded settings: those taken that are not the defaults, and
    those given anew that differ from the run's (old -> new)."""
    if (recorded := of_run_folder(args, quiet=True)) is None:  # said once already, by the parse
        return
    where, settings = recorded
    now = json.loads(json.dumps(recordable(args)))  # as the history holds it
    named = [f"--{dest.replace('_', '-')}" for dest, source in sources.items()
             if source == where and getattr(args, dest) != defaults.get(dest)]
    changed = [f"--{dest.replace('_', '-')} {shown(settings[dest])} -> {shown(now[dest])}"
               for dest, source in sources.items()
               if source != where and dest in settings and dest in now
               and settings[dest] != now[dest] and dest != "out"]  # a run folder moved
    parts = [f"the settings the command does not give are the run's, from {where}: "
             f"{', '.join(named) or 'the defaults'}"] if where in sources.values() else []
    parts += [f"given anew, other than the run's: {', '.join(changed)}"] if changed else []
    if parts:
        logger.info(f"tupe-pretrain: {'; '.join(parts)} (--print-config shows them)")


def shown(value) -> str:
    """A recorded value as a command line gives it."""
    return " ".join(map(str, value)) if isinstance(value, list) else "(unset)" if value is None \
        else json.dumps(value) if isinstance(value, bool) else str(value)
