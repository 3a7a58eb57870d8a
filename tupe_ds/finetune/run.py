"""tupe-finetune: fine-tune an exported model on a GLUE task, over learning rates and seeds.

    tupe-finetune --model exported/large --task rte --train RTE/train.tsv --valid RTE/dev.tsv \\
        --out finetuned/rte
    tupe-finetune --model exported/large --task mnli --train MNLI/train.tsv \\
        --valid m=MNLI/dev_matched.tsv mm=MNLI/dev_mismatched.tsv --out finetuned/mnli \\
        --lr 2e-5 3e-5 --seeds 1 2 3
    deepspeed --num_gpus 8 --module tupe_ds.finetune.run ...   (data parallel; torchrun too)

The paper's setting (Table 2): Adam (beta 0.9/0.999, eps 1e-6), weight decay 0.01, learning rates
{2e-5, 3e-5, 4e-5, 5e-5}, batch 32, 6% warm-up then linear decay to zero, clip 1.0, dropout 0.1,
10 epochs (5 for MNLI, QQP and QNLI), 5 seeds: a configuration scores the median of its seeds'
final dev-set metric, and the task the best configuration. OUT gets TASK.md / TASK.json (every
seed, the medians) and results.md / results.json: the best of every task fine-tuned into OUT;
while it trains, TASK.log.jsonl and tensorboard/TASK/ (monitor.py).
"""

from tupe_ds.tools import startup  # noqa: F401  (first: the collector paused while they import)
from tupe_ds.tools.errors import (BatchSizeError, CommandRefused, ExportError, NotRegularFile,
                                  TaskBusy, TaskDataError)
from tupe_ds.tools.third_party_warnings import add_verbose_flag  # filters import warnings
import argparse
import logging
import math
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tupe_ds.distributed import launch
from tupe_ds.distributed.parallel import accelerator_device, end_distributed, share_cpu_cores
from tupe_ds.export.read import exported_config, load_exported
from tupe_ds.finetune.flags import (DEFAULT_GLOBAL_BATCH, add_batch_flags, global_batch_size,
                                    list_of)
from tupe_ds.finetune.metrics import METRICS
from tupe_ds.finetune.monitor import TrialMonitor, keep_only
from tupe_ds.finetune.progress import Progress, finetune_settings, finished, hold
from tupe_ds.finetune.report import write_reports
from tupe_ds.finetune.tasks import TASKS, ExampleTokenizer, Task, read_examples
from tupe_ds.model.layers import embed
from tupe_ds.tools import command_line, entry
from tupe_ds.train.optim import parameter_groups

logger = logging.getLogger(__name__)

PAPER_LEARNING_RATES = [2e-5, 3e-5, 4e-5, 5e-5]


class SequenceClassifier(nn.Module):
    """The exported embedding and encoder, and a head on the final state of [CLS]: dense, tanh,
    dropout, linear to the task's labels (one output for a regression)."""

    def __init__(self, pretrained, outputs: int, dropout: float):
        super().__init__()
        config = pretrained.model_config
        self.embedding, self.encoder = pretrained.embedding, pretrained.encoder
        self.max_positions = config.max_position_embeddings
        h = config.hidden_size
        self.head = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Dropout(dropout),
                                  nn.Linear(h, outputs))
        for layer in (self.head[0], self.head[3]):
            nn.init.normal_(layer.weight, std=config.init_std)
            nn.init.zeros_(layer.bias)

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(embed(self.embedding, input_ids, self.max_positions),
                              attention_mask == 0)
        return self.head(hidden[0])  # [n, b, h]: position 0 is [CLS] -> [b, outputs]


def parse_valid(values: list) -> dict:
    """["m=dev_matched.tsv", "dev.tsv"] -> {"m": path, "dev": path}; an '=' after a '/' is part
    of the path (as in --data's NAME=FOLDER)."""
    named = {}
    for value in values:
        name, equals, path = value.partition("=")
        if not (equals and name and os.sep not in name):
            name, path = "", value
        named[name or os.path.splitext(os.path.basename(path))[0]] = path
    return named


def run_one(args, task: Task, data: dict, lr: float, seed: int, device, grid: tuple) -> dict:
    """One fine-tuning run: {valid set: {metric: value}} after the last epoch. `grid`: (its
    number, the grid's trials, the trials after it still to do)."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    batch_size = args.global_batch_size
    torch.manual_seed(seed)
    pretrained, _, _ = load_exported(args.model)
    model = SequenceClassifier(pretrained, task.num_outputs, args.dropout).to(device)
    trained = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(parameter_groups(model, args.weight_decay), lr=lr,
                                  betas=(0.9, 0.999), eps=1e-6)
    ids, labels = data["train"]
    epochs = args.epochs or task.epochs
    # a last batch too small to give every rank an example is left out
    steps_per_epoch = len(ids) // batch_size + (len(ids) % batch_size >= world)
    steps = epochs * steps_per_epoch
    warmup = max(1, round(args.warmup_ratio * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: s / warmup if s < warmup else max(0.0, (steps - s) / max(1, steps - warmup)))
    loss_fn = nn.MSELoss() if task.labels is None else nn.CrossEntropyLoss()
    order_rng = np.random.default_rng(seed)
    monitor = TrialMonitor(args.out, task, lr, seed, epochs, steps_per_epoch, device,
                           writer=rank == 0, grid=grid)
    for epoch in range(1, epochs + 1):
        trained.train()
        monitor.start_epoch(epoch)
        order = order_rng.permutation(len(ids))
        for start in range(0, steps_per_epoch * batch_size, batch_size):
            mine = order[start:start + batch_size][rank::world]  # this rank's share
            input_ids, mask = data["tokenizer"].batch([ids[i] for i in mine])
            target = torch.tensor([labels[i] for i in mine],
                                  dtype=torch.float if task.labels is None else torch.long)
            output = trained(input_ids.to(device), mask.to(device))
            loss = loss_fn(output.squeeze(-1) if task.labels is None else output, target.to(device))
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            stepped_at = schedule.get_last_lr()[0]
            schedule.step()
            monitor.trained(loss.item(), len(mine), stepped_at)
        results = evaluate(model, task, data, device)
        monitor.evaluated(results)
    monitor.close()
    return results


@torch.no_grad()
def evaluate(model, task: Task, data: dict, device) -> dict:
    """{valid set: {metric: value, "halves": {"even" and "odd": {metric: value}}}}: the halves
    (for sets of 4 examples or more) are the set's examples at even and odd positions in file
    order (0, 2, 4, ... and 1, 3, ...),
    for a learning-rate choice made on one half and reported on the other
    (report.held_out_median). Each rank predicts its share, rank 0's view is gathered."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    model.eval()
    results = {}
    for name, (ids, labels) in data["valid"].items():
        mine = list(range(rank, len(ids), world))
        predictions = []
        for start in range(0, len(mine), 64):
            input_ids, mask = data["tokenizer"].batch([ids[i] for i in mine[start:start + 64]])
            output = model(input_ids.to(device), mask.to(device)).float().cpu()
            predicted = output.squeeze(-1) if task.labels is None else output.argmax(-1)
            predictions += predicted.tolist()
        pairs = list(zip(mine, predictions))
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, pairs)
            pairs = [pair for part in gathered for pair in part]
        predicted, labels = np.array([p for _, p in sorted(pairs)]), np.array(labels)
        results[name] = {m: METRICS[m](predicted, labels) for m in task.metrics}
        if len(labels) >= 4:  # a half of one example has no correlation, of none no accuracy
            results[name]["halves"] = {
                half: {m: METRICS[m](predicted[start::2], labels[start::2])
                       for m in task.metrics}
                for half, start in (("even", 0), ("odd", 1))}
    return results


def stop_for_requeue(progress: str) -> None:
    """SIGUSR1 (Slurm, before the time limit): stop now with exit code 0, for the job to requeue
    itself; the finished (learning rate, seed) results are in `progress` already."""
    # a signal handler: os.write, not logging, whose lock the interrupted code may hold
    os.write(1, f"SIGUSR1: stopping; the finished runs are kept in {progress}, and the same "
                "command goes on from there\n".encode())
    os._exit(0)


def parser() -> argparse.ArgumentParser:
    p = command_line.Parser(prog="tupe-finetune", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    add_verbose_flag(p)
    command_line.add_config_flags(p)
    p.add_argument("--model", required=True, help="a folder written by tupe-export")
    p.add_argument("--task", required=True, choices=sorted(TASKS))
    p.add_argument("--train", required=True,
                   help="training file (.tsv in GLUE's layout, .csv, .jsonl)")
    p.add_argument("--valid", required=True, nargs="+", help="dev file(s), NAME=FILE to name them")
    p.add_argument("--out", required=True,
                   help="results folder, shared by tasks: TASK.md/.json, results.md/.json, the "
                        "curves in TASK.log.jsonl and tensorboard/TASK/")
    p.add_argument("--lr", **list_of(float, "LR"), default=PAPER_LEARNING_RATES,
                   help="the learning rates tried (default: the paper's 2e-5 3e-5 4e-5 5e-5)")
    p.add_argument("--seeds", **list_of(int, "SEED"), default=(1, 2, 3, 4, 5),
                   help="each learning rate's seeds (default: 1 2 3 4 5)")
    p.add_argument("--epochs", type=int,
                   help="default: the paper's (5 for mnli, qqp, qnli, else 10)")
    add_batch_flags(p)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--dropout", type=float, default=0.1, help="of the classification head")
    p.add_argument("--max-length", type=int, default=512,
                   help="tokens per example, [CLS] included; at most the model's pretraining "
                        "sequence length")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    command_line.paths(p, "model", "train", "out", named=["valid"])
    return p


def given_by_task(args: argparse.Namespace) -> dict:
    """{dest: (value, where)} of the flags left unset whose value the run takes from the task or
    the paper (--print-config)."""
    found = {}
    if args.task in TASKS:
        found["epochs"] = (TASKS[args.task].epochs, f"the paper's for {args.task}")
    if args.per_device_train_batch_size is None:
        found["global_batch_size"] = (DEFAULT_GLOBAL_BATCH, "the paper's")
    return found


def check_numbers(args: argparse.Namespace, task: Task) -> None:
    """CommandRefused naming the first number no fine-tuning run can train with."""
    shortest = 1 + 2 * len(task.text_columns)  # [CLS], then a token and [SEP] per text
    for wrong, problem in (
            (not all(0 < lr < math.inf for lr in args.lr),  # nan compares false
             f"--lr {' '.join(map(str, args.lr))}: each a positive, finite number"),
            (not all(0 <= seed < 2**32 for seed in args.seeds),
             f"--seeds {' '.join(map(str, args.seeds))}: each a whole number from 0 to 2**32-1"),
            (args.epochs is not None and args.epochs < 1, f"--epochs {args.epochs}: at least 1"),
            (not 0 <= args.warmup_ratio <= 1,
             f"--warmup-ratio {args.warmup_ratio}: a share of the steps, from 0 to 1"),
            (not 0 <= args.weight_decay < math.inf,
             f"--weight-decay {args.weight_decay}: 0 or a positive, finite number"),
            (not 0 <= args.dropout < 1, f"--dropout {args.dropout}: from 0 to below 1"),
            (args.max_length < shortest, f"--max-length {args.max_length}: at least {shortest} "
                                         f"for {task.name} ([CLS], then a token and [SEP] per "
                                         "text)")):
        if wrong:
            raise CommandRefused(problem)


def main(argv=None) -> int:
    return entry.run("tupe-finetune", lambda: finetune(argv))


def finetune(argv) -> int:
    """tupe-finetune's work: the inputs checked (each error there a CommandRefused), then every
    learning rate and seed of the grid not done before fine-tuned, and the task's reports."""
    args = command_line.parse(parser(), argv, unset=given_by_task)
    launch.discover()
    task = TASKS[args.task]
    check_numbers(args, task)
    valid = parse_valid(args.valid)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    writer = int(os.environ.get("RANK", "0")) == 0
    try:  # everything about the inputs is checked before a model is built
        args.global_batch_size = global_batch_size(args, processes)
        model_config, description = exported_config(args.model)
        settings = finetune_settings(args, task, description.get("source"), valid)
        if finished(args.out, task.name, settings, args.lr, args.seeds):
            logger.info(f"{task.name}: finished before with these settings "
                        f"({args.out}/{task.name}.json); nothing to do")
            return 0
        max_length = min(args.max_length, model_config.seq_length)
        if max_length < args.max_length:
            logger.info(f"--max-length {args.max_length} lowered to {max_length}: the model was "
                        f"pretrained on {max_length}-token sequences")
        tokenizer = ExampleTokenizer(os.path.join(args.model, "tokenizer.json"),
                                     model_config.vocab_size, max_length)
        data = {"tokenizer": tokenizer, "valid": {}}
        examples = read_examples(args.train, task)
        if len(examples) < processes:
            raise TaskDataError(f"--train {args.train}: {len(examples)} example(s), fewer than "
                                f"the {processes} processes: no step would train; give more "
                                "examples or fewer processes")
        data["train"] = (tokenizer(examples), [label for _, label in examples])
        for name, path in valid.items():
            examples = read_examples(path, task)
            data["valid"][name] = (tokenizer(examples), [label for _, label in examples])
        if writer:  # rank 0 alone keeps the task's files; the launcher ends the others
            held = hold(args.out, task.name)  # noqa: F841  (held until the process ends)
            keep_only(args.out, task.name, Progress(args.out, task.name, settings, True).results)
    except (BatchSizeError, TaskDataError, ExportError, FileNotFoundError, TaskBusy,
            NotRegularFile) as error:  # here only: the same raised mid-run stays a traceback
        raise CommandRefused(str(error)) from None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = accelerator_device()  # before any process group: see end_distributed
    if device.type == "cpu":
        share_cpu_cores()
    if processes > 1:
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    progress = Progress(args.out, task.name, settings, writer)
    signal.signal(signal.SIGUSR1, lambda *_: stop_for_requeue(progress.path))
    runs, grid = {}, [(lr, seed) for lr in args.lr for seed in args.seeds]
    for number, (lr, seed) in enumerate(grid, start=1):
        results = progress.get(lr, seed)
        if results is None:
            after = sum(progress.get(*trial) is None for trial in grid[number:])
            results = progress.record(lr, seed, run_one(args, task, data, lr, seed, device,
                                                        (number, len(grid), after)))
        elif writer:
            logger.info(f"{task.name} lr {lr:g} seed {seed}: done before ({progress.path}), "
                        "not redone")
        runs.setdefault(lr, {})[seed] = results
    if writer:
        summary = write_reports(args.out, task, runs, settings)
        for label, medians in (("best " + summary["best"], summary["best_median"]),
                               ("held-out learning-rate choice", summary["held_out_median"])):
            if medians:
                logger.info(f"{label}: " + ", ".join(
                    f"{name} {summary['metric']} {values[summary['metric']]:.4f}"
                    for name, values in medians.items()))
        logger.info(f"results: {args.out}/{task.name}.md (every seed), {args.out}/results.md "
                    f"(all tasks in {args.out}), and their .json")
    end_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
