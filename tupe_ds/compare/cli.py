"""tupe-compare: pretrain one model per positional encoding (and seed) on the same data and
batches, fine-tune each on GLUE tasks, then report how they compare (validation curves, steps to
the baseline's loss, positional correlations, the paper's Table 1 with 95% intervals).

    tupe-compare run --data prep/ --encodings tupe-r bert-a --model bert-base --steps 10000 \\
        --seeds 1 2 3 --nproc 8 --out cmp/ --ds-config ds_configs/bert_base_fp16.json \\
        [--recipe modern] [--finetune glue/ [--tasks rte mrpc] [--finetune-lr 2e-5 3e-5 ...]] \\
        [flags]
    tupe-compare report cmp/          # report.md, report.json, figures/ from what the runs left
    slurm/submit_compare.sh cmp/ [the run flags]     # one Slurm array task per run (and one per
                                                     # run and task), then the report

Flags tupe-compare does not know go to every tupe-pretrain run. The same command again resumes
what is unfinished and starts nothing that is done. List flags take their values
space-separated, or comma-separated as earlier versions did (--seeds 1,2,3).
"""

from tupe_ds.tools import startup  # noqa: F401  (first: the collector paused while they import)
from tupe_ds.tools.errors import CompareError
from tupe_ds.tools.third_party_warnings import add_verbose_flag  # filters import warnings
import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys

from tupe_ds.compare.finetuning import finetune_flags, status_name
from tupe_ds.compare.launching import record_status
from tupe_ds.compare.plan import Plan, read_plan
from tupe_ds.compare.recipes import RECIPES, SCHEDULE_FLAGS, modern, without
from tupe_ds.compare.report import headline, write_report
from tupe_ds.compare.runner import run_all
from tupe_ds.distributed.launchers import LAUNCHERS, users_port
from tupe_ds.finetune.flags import DEFAULT_GLOBAL_BATCH, list_of
from tupe_ds.finetune.tasks import TASKS
from tupe_ds.machine.doctor import probe
from tupe_ds.model.config import ENCODINGS
from tupe_ds.tools import command_line, entry
from tupe_ds.train.flags import parser as pretrain_parser

logger = logging.getLogger(__name__)


def plan_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = command_line.Parser(prog=prog, description=description, allow_abbrev=False,
                                epilog="Other flags (--ds-config, --seq-len, --global-batch, "
                                       "--lr, --eval-interval, ...) go to every tupe-pretrain run, "
                                       "after --pretrain-flags.")
    add_verbose_flag(p)
    command_line.add_config_flags(p)
    p.add_argument("--data", required=True, nargs="+", metavar="FOLDER | W1 FOLDER1 W2 ...",
                   help="a folder written by tupe-prep, or a weighted blend of several, "
                        "NAME=FOLDER naming one (tupe-pretrain's --data)")
    p.add_argument("--encodings", required=True, **list_of(str, "ENCODING"),
                   help=f"from: {', '.join(ENCODINGS)}")
    p.add_argument("--seeds", **list_of(int, "SEED"), default=(1,),
                   help="a seed fixes the data order and masking (the encodings' layer weights "
                        "still start differently)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps of every run")
    p.add_argument("--model", required=True, help="a preset (an ELECTRA pair with --objective "
                                                  "electra)")
    p.add_argument("--objective", default="mlm", choices=["mlm", "electra"])
    p.add_argument("--out", required=True,
                   help="comparison folder: compare.json, runs/, logs/, exports/, report.md")
    p.add_argument("--baseline", help="the encoding the others race to (default: bert-a if "
                                      "compared, else the first of --encodings)")
    p.add_argument("--nproc", type=int,
                   help="processes (GPUs) per run (default: this machine's GPUs, else 1)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="deepspeed")
    p.add_argument("--pretrain-flags", nargs="*", default=[], metavar="FLAG",
                   help="tupe-pretrain flags and values for every run, as a list in a --config "
                        "file (pretrain-flags = [\"--seq-len\", \"128\"]); on the command line "
                        "give them as they are, among tupe-compare's")
    p.add_argument("--recipe", choices=RECIPES, default="paper",
                   help="paper: the runs train as the flags and --ds-config say; modern: adds 30%% "
                        "masking, a warmup-stable-decay schedule, a batch ramp scaled to the run "
                        "and bf16 where the GPUs have it, a flag given winning over the recipe's "
                        "(docs/compare.md)")
    glue = p.add_argument_group("fine-tuning (tupe-finetune on every complete run)")
    glue.add_argument("--finetune", metavar="GLUE_DIR",
                      help="GLUE's tasks in GLUE's layout (GLUE_DIR/RTE/train.tsv, dev.tsv, ...)")
    glue.add_argument("--tasks", **list_of(str, "TASK"),
                      help=f"from {', '.join(TASKS)} (default: those in GLUE_DIR)")
    glue.add_argument("--finetune-lr", **list_of(float, "LR"),
                      help="learning rates (default: the paper's 2e-5 3e-5 4e-5 5e-5)")
    glue.add_argument("--finetune-seeds", **list_of(int, "SEED"), help="default: 1 2 3 4 5")
    glue.add_argument("--finetune-epochs", type=int,
                      help="default: the paper's (5 for mnli, qqp, qnli, else 10)")
    glue.add_argument("--finetune-global-batch-size", "--finetune-batch-size",
                      type=command_line.positive, metavar="N",
                      help="examples per optimizer step summed over the --nproc processes "
                           f"(default: {DEFAULT_GLOBAL_BATCH})")
    glue.add_argument("--finetune-max-length", type=int, help="tokens per example (default 512)")
    command_line.paths(p, "out", "finetune", blend=["data"])
    command_line.passes_flags(p, "pretrain_flags", pretrain_parser)
    return p


FINETUNE_FLAGS = {"finetune_lr": "--lr", "finetune_seeds": "--seeds", "finetune_epochs": "--epochs",
                  "finetune_global_batch_size": "--global-batch-size",
                  "finetune_max_length": "--max-length"}


def finetune_plan(args) -> dict:
    """The Plan's fields for fine-tuning: the GLUE folder, its tasks, tupe-finetune's flags."""
    given = [flag for flag in ("tasks", *FINETUNE_FLAGS) if getattr(args, flag) is not None]
    if args.finetune is None:
        if given:
            raise CompareError(f"--{given[0].replace('_', '-')} needs --finetune GLUE_DIR")
        return {}
    directory = os.path.abspath(args.finetune)
    if not os.path.isdir(directory):
        raise CompareError(f"--finetune {directory}: no such folder")
    found = [task for task in TASKS if os.path.isdir(os.path.join(directory,
                                                                  TASKS[task].glue_folder))]
    tasks = args.tasks if args.tasks is not None else tuple(found)
    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        raise CompareError(f"--tasks: {', '.join(unknown) or 'none given or found'}; choose from "
                           f"{', '.join(TASKS)} (GLUE_DIR holds their folders: "
                           f"{', '.join(t.glue_folder for t in TASKS.values())})")
    batch = args.finetune_global_batch_size or DEFAULT_GLOBAL_BATCH
    if batch < args.nproc:
        raise CompareError(f"--finetune-global-batch-size {batch}: fewer examples than the "
                           f"{args.nproc} processes (--nproc) of each fine-tune; give at least "
                           f"{args.nproc}")
    flags = []
    for field, flag in FINETUNE_FLAGS.items():
        value = getattr(args, field)
        if value is not None:
            flags += [flag, *map(str, value if isinstance(value, tuple) else (value,))]
    return {"finetune": directory, "tasks": tuple(tasks), "finetune_flags": tuple(flags)}


def absolute_data(values: list) -> tuple:
    """--data's values with its folders made absolute: a folder, or weights and folders, a
    NAME=FOLDER keeping its name."""
    from tupe_ds.data.sources import named_folder  # imports numpy: not for the other commands

    def absolute(value):
        try:
            name, folder = named_folder(value)
        except ValueError as error:
            raise CompareError(str(error)) from None
        return os.path.abspath(value) if folder == value else f"{name}={os.path.abspath(folder)}"

    if len(values) == 1:
        return (absolute(values[0]),)
    return tuple(value if i % 2 == 0 else absolute(value) for i, value in enumerate(values))


def make_plan(args, pretrain_flags: list) -> Plan:
    unknown = [e for e in args.encodings if e not in ENCODINGS]
    if unknown:
        raise CompareError(f"--encodings: {', '.join(unknown)}; choose from {', '.join(ENCODINGS)}")
    if len(set(args.encodings)) < len(args.encodings) or len(set(args.seeds)) < len(args.seeds):
        raise CompareError("--encodings and --seeds: each value once")
    if args.nproc is None:
        import torch

        args.nproc = max(torch.cuda.device_count(), 1)
    if args.nproc < 1:
        raise CompareError("--nproc must be at least 1")
    baseline = args.baseline or ("bert-a" if "bert-a" in args.encodings else args.encodings[0])
    plan = Plan(out=os.path.abspath(args.out), data=absolute_data(args.data),
                encodings=args.encodings, seeds=args.seeds, steps=args.steps, baseline=baseline,
                processes=args.nproc, pretrain_flags=("--model", args.model, "--objective",
                                                      args.objective, *pretrain_flags),
                **finetune_plan(args))
    plan.check_flags()  # before tupe-pretrain reads the first run's flags (plan.check, a recipe)
    if args.recipe == "paper":
        return plan
    machine = probe()
    # the batch split and the warmup as the user's flags give them, a schedule they name left
    # out (--lr-schedule wsd without the --decay-steps the recipe adds would be refused)
    config = dataclasses.replace(plan, pretrain_flags=without(
        plan.pretrain_flags, *SCHEDULE_FLAGS)).first_run_config(machine)
    warmup = config.ds_config.get("scheduler", {}).get("params", {}).get("warmup_num_steps", 0)
    with open(config.ds_config_path) as f:
        ds_config = json.load(f)
    recipe = modern(plan.steps, config.batch_split, warmup, machine, plan.pretrain_flags,
                    ds_config, config.ds_config_path, plan.out)
    return dataclasses.replace(plan, recipe=recipe)


def planned(prog: str, argv: list) -> tuple:
    """(Plan, launcher), checked by tupe-pretrain's own rules and saved to OUT/compare.json."""
    args = command_line.parse(plan_parser(prog, __doc__.split("\n")[0]), argv,
                              rest_into="pretrain_flags")
    # their paths absolute, as --data's: the plan's flags work from any folder (a Slurm task's)
    pretrain_flags = command_line.passed_flags(os.getcwd(), args.pretrain_flags,
                                               pretrain_parser())
    try:
        users_port()  # before any run starts
    except ValueError as error:
        raise CompareError(str(error)) from None
    plan = make_plan(args, pretrain_flags)
    plan.check()
    plan.save()
    for note in plan.recipe.notes:  # a warning, on stderr: slurm/submit_compare.sh reads stdout
        logger.warning(f"tupe-compare: --recipe {plan.recipe.name}: {note}")
    return plan, args.launcher


def summary(report: dict) -> str:
    race = report["race"]
    lines = []
    for encoding, curve in report["curves"].items():
        reached = race["encodings"].get(encoding, {})
        share = reached.get("share_of_baseline_steps")
        lines.append(f"  {encoding:>15}: final valid loss {curve['mean'][-1]:.4f}"
                     + (f", reached {race['baseline']}'s final loss at step {reached['step']} "
                        f"({share:.0%} of its steps)" if share else ""))
    return "\n".join(lines)


# the commands whose arguments are positional (Slurm's array tasks', and report)
USAGE = {"report": "OUT", "run-flags": "OUT INDEX", "finetune-flags": "OUT INDEX",
         "finetune-ended": "OUT INDEX EXIT LOG"}


def plan_and_item(command: str, rest: list, kind: str) -> tuple:
    """(Plan, item INDEX of its `kind`, runs or finetunes) of `tupe-compare COMMAND OUT INDEX`."""
    plan = read_plan(os.path.abspath(rest[0])) if rest else None
    items = getattr(plan, kind, ())
    if plan is None or len(rest) != 2 or not rest[1].isdigit() or int(rest[1]) >= len(items):
        below = f", INDEX below {len(items)}" if plan else ""
        raise CompareError(f"usage: tupe-compare {command} {USAGE[command]}{below}")
    return plan, items[int(rest[1])]


def main(argv=None) -> int:
    return entry.run("tupe-compare", lambda: compare(argv), errors=(CompareError,))


def compare(argv) -> int:
    """tupe-compare's work: its first argument's command (plan, run, report, and the Slurm array
    tasks' run-flags, finetune-flags, finetune-ended); 1 where a run or fine-tune failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = ["--verbose"] if "--verbose" in argv[:1] else []  # read at import: before the command
    argv = argv[len(verbose):]
    commands = ("run", "plan", "report", "run-flags", "finetune-flags", "finetune-ended")
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{__doc__}Each command's flags: tupe-compare COMMAND --help "
              f"({', '.join(commands)})")
        return 0
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        raise CompareError(f"the first argument is one of {', '.join(commands)}")
    command, rest = argv[0], argv[1:]
    if command in USAGE and {"-h", "--help"} & set(rest):
        print(f"usage: tupe-compare {command} {USAGE[command]}")
        return 0
    if command == "plan":  # what slurm/submit_compare.sh runs before submitting the arrays
        plan, _ = planned("tupe-compare plan", [*verbose, *rest])
        logger.info(f"{len(plan.runs)} runs planned in {plan.out}: "
                    + ", ".join(run.name for run in plan.runs))
        if plan.tasks:
            logger.info(f"{len(plan.finetunes)} fine-tunes planned: each run on "
                        + ", ".join(plan.tasks))
        return 0
    if command == "run-flags":  # OUT INDEX: one Slurm array task's tupe-pretrain flags
        plan, run = plan_and_item(command, rest, "runs")
        print("\n".join(plan.pretrain_argv(run)))
        return 0
    if command == "finetune-flags":  # OUT INDEX: a fine-tune array task's, after the export
        plan, (run, task) = plan_and_item(command, rest, "finetunes")
        with contextlib.redirect_stdout(sys.stderr):  # the export's messages: not flags
            flags = finetune_flags(plan, run, task)
        print("\n".join(flags))
        return 0
    if command == "finetune-ended":  # OUT INDEX EXIT LOG: a fine-tune array task's end
        plan, finetune = plan_and_item(command, rest[:2], "finetunes")
        if len(rest) != 4 or not rest[2].isdigit():
            raise CompareError(f"usage: tupe-compare {command} {USAGE[command]}")
        record_status(plan.out, status_name(*finetune), int(rest[2]), rest[3])
        return 0
    if command == "report":
        if len(rest) != 1:
            raise CompareError(f"usage: tupe-compare {command} {USAGE[command]}")
        plan = read_plan(os.path.abspath(rest[0]))
        exits = {}
    else:
        plan, launcher = planned("tupe-compare run", [*verbose, *rest])
        exits = run_all(plan, launcher)
    report = write_report(plan)
    logger.info(summary(report))
    logger.info("\n".join(headline(report)))
    logger.info(f"report: {os.path.join(plan.out, 'report.md')} (and report.json, figures/)")
    failed = [name for name, code in exits.items() if code]
    if failed:
        logger.error(f"tupe-compare: {len(failed)} run(s) or fine-tune(s) failed: "
                     f"{', '.join(failed)}; run the same command again to retry them")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
