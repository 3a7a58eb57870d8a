"""tupe-compare: pretrain one model per positional encoding (and seed) on the same data and
batches, then report how they compare (validation curves, steps to the baseline's loss, positional
correlations, fine-tuning).

    tupe-compare run --data prep/ --encodings tupe-r,bert-a --model bert-base --steps 10000 \\
        --seeds 1,2,3 --nproc 8 --out cmp/ --ds-config ds_configs/bert_base_fp16.json [flags]
    tupe-compare report cmp/          # report.md, report.json, figures/ from what the runs left
    slurm/submit_compare.sh cmp/ [the run flags]     # one Slurm array task per run, then the report

Flags tupe-compare does not know go to every tupe-pretrain run. The same command again resumes
what is unfinished and starts nothing that is done.
"""

import argparse
import os
import sys

from tupe_ds.compare.plan import CompareError, Plan, read_plan
from tupe_ds.compare.report import write_report
from tupe_ds.compare.runner import LAUNCHERS, run_all
from tupe_ds.model.config import ENCODINGS


def comma_list(kind):
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(item) for item in text.split(",") if item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {kind.__name__}")
    return parse


def plan_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                epilog="Other flags (--ds-config, --seq-len, --global-batch, "
                                       "--lr, --eval-interval, ...) go to every tupe-pretrain run.")
    p.add_argument("--data", required=True, help="a folder written by tupe-prep")
    p.add_argument("--encodings", required=True, type=comma_list(str),
                   help=f"comma-separated, from: {', '.join(ENCODINGS)}")
    p.add_argument("--seeds", type=comma_list(int), default=(1,),
                   help="comma-separated; each seed fixes the initialisation and the data order")
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
    return p


def make_plan(args, pretrain_flags: list) -> Plan:
    unknown = [e for e in args.encodings if e not in ENCODINGS]
    if unknown or not args.encodings:
        raise CompareError(f"--encodings: {', '.join(unknown) or 'none given'}; choose from "
                           f"{', '.join(ENCODINGS)}")
    if len(set(args.encodings)) < len(args.encodings) or len(set(args.seeds)) < len(args.seeds):
        raise CompareError("--encodings and --seeds: each value once")
    if not args.seeds:
        raise CompareError("--seeds: at least one")
    if args.nproc is None:
        import torch

        args.nproc = max(torch.cuda.device_count(), 1)
    if args.nproc < 1:
        raise CompareError("--nproc must be at least 1")
    baseline = args.baseline or ("bert-a" if "bert-a" in args.encodings else args.encodings[0])
    return Plan(out=os.path.abspath(args.out), data=os.path.abspath(args.data),
                encodings=args.encodings, seeds=args.seeds, steps=args.steps, baseline=baseline,
                processes=args.nproc, pretrain_flags=("--model", args.model, "--objective",
                                                      args.objective, *pretrain_flags))


def planned(prog: str, argv: list) -> tuple:
    """(Plan, launcher), checked by tupe-pretrain's own rules and saved to OUT/compare.json."""
    args, pretrain_flags = plan_parser(prog, __doc__.split("\n")[0]).parse_known_args(argv)
    plan = make_plan(args, pretrain_flags)
    plan.check()
    plan.save()
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("run", "plan", "report", "run-flags")
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        print(f"tupe-compare: error: the first argument is one of {', '.join(commands)}",
              file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "plan":  # what slurm/submit_compare.sh runs before submitting the array
            plan, _ = planned("tupe-compare plan", rest)
            print(f"{len(plan.runs)} runs planned in {plan.out}: "
                  + ", ".join(run.name for run in plan.runs))
            return 0
        if command == "run-flags":  # OUT INDEX: one Slurm array task's tupe-pretrain flags
            plan = read_plan(os.path.abspath(rest[0]))
            if not (len(rest) == 2 and rest[1].isdigit() and int(rest[1]) < len(plan.runs)):
                raise CompareError(f"usage: tupe-compare run-flags OUT INDEX, INDEX below "
                                   f"{len(plan.runs)}")
            print("\n".join(plan.pretrain_argv(plan.runs[int(rest[1])])))
            return 0
        if command == "report":
            if len(rest) != 1:
                raise CompareError("usage: tupe-compare report OUT")
            plan = read_plan(os.path.abspath(rest[0]))
            exits = {}
        else:
            plan, launcher = planned("tupe-compare run", rest)
            exits = run_all(plan, launcher)
        report = write_report(plan)
    except CompareError as error:
        print(f"tupe-compare: error: {error}", file=sys.stderr)
        return 2
    print(summary(report))
    print(f"report: {os.path.join(plan.out, 'report.md')} (and report.json, figures/)")
    failed = [name for name, code in exits.items() if code]
    if failed:
        print(f"tupe-compare: {len(failed)} run(s) failed: {', '.join(failed)}; run the same "
              "command again to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
