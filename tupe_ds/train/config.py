"""A run's typed configuration: `load()` puts the command line (`flags.py`), the process layout,
the DeepSpeed config (`ds_config.py`), the checkpoint to resume or start from (checked against
this run: `checkpoint/`, a decay branch's: `checkpoint/init_from.py`) and the model configs together in
a `RunConfig`, all checked before any heavy work."""

import argparse
import dataclasses
import errno
import logging
import os
from dataclasses import dataclass
from typing import Optional

from tokenizers import Tokenizer

from tupe_ds.data.masking import MaskingScheme
from tupe_ds.data.sources import parse_sources
from tupe_ds.distributed.parallel import accelerator_device
from tupe_ds.machine import doctor
from tupe_ds.model.config import PRESETS, ModelConfig
from tupe_ds.model.electra import PAIRS
from tupe_ds.tools import command_line
from tupe_ds.tools.errors import Refused, RunFolderBusy
from tupe_ds.train import nonfinite, optimizer_boundary
from tupe_ds.train.checkpoint import same_run
from tupe_ds.train.checkpoint.init_from import (InitPlan, check_branch, plan_init,
                                                refuse_another_branch)
from tupe_ds.train.checkpoint.resume import ResumePlan, plan_resume, what_is_where
from tupe_ds.train.checkpoint.same_run import refuse_another_run, run_identity
from tupe_ds.train.data_folders import data_sources, index_cache_folder
from tupe_ds.train.ds_config import BatchSplit, deepspeed_config, given_by_config
from tupe_ds.train.flags import SHAPE_FLAGS, check_flags, fail, parser
from tupe_ds.train.masking_flags import masking_scheme
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train.run_folder import lock as folder_lock
from tupe_ds.train.run_folder import recorded_settings
from tupe_ds.train.run_folder.lock import RunLock

CPU_CONFIG = doctor.CPU_CONFIG


@dataclass(frozen=True)
class Layout:
    """How the run's processes split the work: tensor x pipeline x data parallel."""
    world_size: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def __str__(self) -> str:
        return f"tp {self.tp}, pp {self.pp}, dp {self.dp}"


@dataclass(frozen=True)
class Intervals:
    """Steps between log lines, validations, checkpoints and positional images."""
    log: int
    eval: int
    save: int
    image: int


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, checked: what `load()` returns."""
    objective: str  # a key of tupe_ds.train.objectives.OBJECTIVES
    model: str  # the preset (or ELECTRA pair) name
    sources: tuple  # (sources.Source,): --data, one folder or the blend's, each with its cache
    out: str
    steps: int
    seq_len: int
    seed: int
    eval_samples: int
    keep_checkpoints: int
    max_nonfinite_steps: int
    check_only: bool
    layout: Layout
    intervals: Intervals
    models: tuple  # (ModelConfig,) for mlm; (discriminator, generator) for electra
    ds_config: dict  # with the command line's overrides
    ds_config_path: str
    prefetch: int  # steps of batches made ahead by a thread
    vectorised_stream: bool  # --data-stream vectorised
    loss_normalization: str  # a mode of tupe_ds.train.normalization
    masking: MaskingScheme  # the objective's, with --mask-rate and --mask-split
    batch_split: BatchSplit  # micro-batch x accumulation x dp, and what set it
    identity: dict  # what defines the stream and the model (checkpoint/same_run.py)
    training: dict  # the optimizer and schedule settings (same_run.training_settings)
    resume_plan: Optional[ResumePlan] = None  # the checkpoint of --out to resume
    init_plan: Optional[InitPlan] = None  # --init-from, for a run with nothing to resume
    branch_origin: Optional[str] = None  # --branch: its --init-from, absolute (run.json)
    allow_training_changes: bool = False  # --allow-training-changes
    lock: Optional[RunLock] = None  # OUT/run.lock, held by rank 0 (run_folder/lock.py)
    optimizer_boundary: str = optimizer_boundary.DEFAULT  # --optimizer-boundary
    settings: Optional[dict] = None  # the command's, as run.json records them (recorded_settings)
    setting_sources: Optional[dict] = None  # where each setting came from (command_line.resolve)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def data(self) -> str:
        """The first --data folder: its tokenizer.json is every source's."""
        return self.sources[0].folder

    @property
    def index_cache(self) -> str:
        return self.sources[0].index_cache

    @property
    def dp_size(self) -> int:
        return self.layout.dp


def used_when_unset(args: argparse.Namespace) -> dict:
    """{dest: (value, where)} of the flags left unset whose value the run takes from elsewhere
    (--print-config): the --ds-config's, the --model preset's shape (BERT's), the objective's
    masking, the device's compile, WSD's decay shape and the --data folders' index cache."""
    values = given_by_config(args)
    objective = OBJECTIVES.get(args.objective)
    if args.objective == "mlm" and args.model in PRESETS:
        values.update({field: (PRESETS[args.model][field], f"the {args.model} preset's")
                       for field in SHAPE_FLAGS.values()})
    if objective is not None:
        masking, whose = objective.default_masking, f"--objective {args.objective}'s"
        values["mask_rate"] = (masking.probability, whose)
        values["mask_split"] = (f"{masking.mask:g},{masking.random:g}", whose)
    zero_stage = args.zero_stage if args.zero_stage is not None else \
        values.get("zero_stage", (0,))[0]
    try:  # the run's own rule (ModelConfig.compile_mode), on a stand-in vocabulary
        compile_mode = model_configs(args, "fp32", 128 * args.tp, zero_stage)[0].compile_mode
        values["compile"] = (compile_mode, f"the device's choice here "
                             f"({accelerator_device().type}; the rule: --compile in --help)")
    except (Refused, KeyError, AssertionError, RuntimeError):
        pass  # said by the run; or DS_ACCELERATOR=cuda where CUDA cannot start
    if args.lr_schedule == "wsd":
        values["decay_shape"] = ("linear", "--lr-schedule wsd's")
    try:
        folders = [source.folder for source in parse_sources(args.data)] if args.data else []
    except ValueError:  # said by the run, which checks --data first
        folders = []
    if folders and args.out:
        caches = [os.path.abspath(index_cache_folder(args, folder)) for folder in folders]
        values["index_cache"] = (caches[0] if len(caches) == 1 else caches,
                                 "each --data folder where this process may write, else "
                                 "OUT/index-cache")
    return values


def load(argv=None, world_size: Optional[int] = None,
         machine: Optional[doctor.Machine] = None, take_lock: bool = False) -> RunConfig:
    """Parse, read the DeepSpeed config, apply the overrides and check everything that can be
    checked without starting a process group: errors say what to change. The run has
    `world_size` processes (default: WORLD_SIZE, else 1), on `machine` (default: this one).
    `take_lock` (tupe-pretrain's rank 0): OUT/run.lock is taken before any checkpoint is read,
    and held by the RunConfig's `lock` (release it); --check-only only checks it."""
    command = parser()
    defaults = {action.dest: action.default for action in command._actions}
    args, setting_sources = command_line.resolve(
        command, argv, recorded=recorded_settings.of_run_folder, unset=used_when_unset)
    if take_lock or args.check_only:  # rank 0 (a --check-only runs alone)
        recorded_settings.say_taken(args, setting_sources, defaults)
    check_flags(args)
    sources = tuple(data_sources(args))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    layout = process_layout(args, world_size)
    ds_config, dtype, batch_split, training = deepspeed_config(args, layout.dp,
                                                               machine or doctor.probe())
    problem = nonfinite.config_problem(ds_config, dtype)
    if problem:
        fail(problem)
    lock = None
    if args.check_only:
        problem = folder_lock.check(args.out)
        if problem:
            fail(problem)
    elif take_lock:
        try:
            lock = RunLock.acquire(args.out)
        except RunFolderBusy as busy:
            fail(str(busy))
        except OSError as error:
            fail(f"--out {args.out}: cannot take its lock ({error}); " + (
                "free space there and run the same command" if error.errno == errno.ENOSPC
                else "give a folder this job may write"))
    try:
        return dataclasses.replace(checked_run(args, sources, layout, ds_config, dtype,
                                               batch_split, training, lock),
                                   setting_sources=setting_sources)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def checked_run(args, sources, layout, ds_config, dtype, batch_split, training,
                lock) -> RunConfig:
    """load(), from the moment the run folder is this run's: the checkpoint to resume or start
    from, checked against the models, identity and training settings of the command."""
    zero_stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    shape = (layout.world_size, layout.tp, layout.pp, zero_stage)
    try:
        resume_plan = plan_resume(args.out, args.resume, args.resume_from, *shape,
                                  fresh_start=args.fresh_start, giving_up=args.giving_up)
    except ValueError as error:
        if args.check_only:  # what is where, above why a run would be refused
            for line in what_is_where(args.out, None)[:-1]:
                logging.getLogger(__name__).info(f"tupe-pretrain: {line}")
        fail(f"--out {args.out}: {error}")
    resharding = resume_plan.resharding if resume_plan else None
    if resharding is not None and resharding.convert:
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    vocab_size = (resharding.saved.vocab_size if resharding
                  else padded_vocab(sources[0].folder, args.tp))
    models = model_configs(args, dtype, vocab_size, zero_stage)
    scheme = masking_scheme(args, OBJECTIVES[args.objective].default_masking)
    identity = run_identity(args.objective, args.model, models, sources, args.seq_len,
                            ds_config["train_batch_size"], scheme, args.seed,
                            args.loss_normalization, batch_split.ramp)
    init_plan = None
    branch_origin = os.path.abspath(args.init_from) if args.branch else None
    if branch_origin and resume_plan is not None and resume_plan.candidates:
        refuse_another_branch(args, resume_plan)
    try:
        if resume_plan is not None and resume_plan.candidates:
            refuse_another_run(resume_plan, identity, training, args.allow_training_changes)
        elif args.init_from:
            init_plan = plan_init(args.init_from, args.init_optimizer, identity, *shape,
                                  branch=args.branch, training=training)
    except ValueError as error:
        fail(str(error))
    resume_plan = moved_rate(args, resume_plan, ds_config)
    if init_plan is not None and init_plan.branch:
        init_plan = check_branch(init_plan, ds_config, args.steps, args.allow_training_changes)
    return RunConfig(objective=args.objective, model=args.model, sources=sources, out=args.out,
                     steps=args.steps, seq_len=args.seq_len, seed=args.seed,
                     eval_samples=args.eval_samples, keep_checkpoints=args.keep_checkpoints,
                     max_nonfinite_steps=args.max_nonfinite_steps, check_only=args.check_only,
                     layout=layout,
                     intervals=Intervals(log=args.log_interval, eval=args.eval_interval,
                                         save=args.save_interval, image=args.image_interval),
                     models=models, ds_config=ds_config, ds_config_path=args.ds_config,
                     prefetch=args.prefetch,
                     vectorised_stream=args.data_stream == "vectorised",
                     loss_normalization=args.loss_normalization, masking=scheme,
                     batch_split=batch_split,
                     identity=identity, training=training, resume_plan=resume_plan,
                     init_plan=init_plan, branch_origin=branch_origin,
                     allow_training_changes=args.allow_training_changes,
                     lock=lock, optimizer_boundary=args.optimizer_boundary,
                     settings=recorded_settings.recordable(args))


def moved_rate(args: argparse.Namespace, plan: Optional[ResumePlan],
               ds_config: dict) -> Optional[ResumePlan]:
    """same_run.moved_rate of the checkpoint a resume tries first, before any process starts (a
    fallback's: resume.agreed); its line among the plan's notes."""
    if not (plan and plan.candidates):
        return plan
    try:
        said = same_run.moved_rate(os.path.join(plan.directory, plan.tag), args.steps,
                                   ds_config.get("scheduler"), args.allow_training_changes)
    except ValueError as error:
        fail(str(error))
    return dataclasses.replace(plan, notes=(*plan.notes, *said))


def process_layout(args: argparse.Namespace, world_size: int) -> Layout:
    model_parallel = args.tp * args.pp
    if world_size % model_parallel:
        layout = f"--tp {args.tp}"
        if args.pp > 1:
            layout += f" x --pp {args.pp} = {model_parallel}"
        fail(f"{layout} does not divide the {world_size} processes")
    return Layout(world_size=world_size, tp=args.tp, pp=args.pp)


def model_configs(args: argparse.Namespace, dtype: str, vocab_size: int,
                  zero_stage: int = 0) -> tuple:
    """(ModelConfig,) for mlm; (discriminator, generator) for electra. ZeRO stage 3 runs eager
    where the device would compile the whole block, and refuses --compile block: it gathers each
    module's parameters in hooks that split a compiled block (62 graph breaks in the tiny
    model's 2 layers), and the TUPE terms traced in it read the empty placeholders it leaves."""
    presets = PAIRS[args.model] if args.objective == "electra" else (args.model,)
    positions = max(args.seq_len,
                    *(PRESETS[p].get("max_position_embeddings", 512) for p in presets))
    try:
        models = tuple(ModelConfig.from_preset(
            preset, pos_encoding=args.pos_encoding, tensor_parallel_size=args.tp,
            vocab_size=vocab_size, seq_length=args.seq_len,
            max_position_embeddings=positions, hidden_dropout=args.dropout,
            attention_dropout=args.dropout, dtype=dtype, compile=args.compile,
            **{field: getattr(args, field) for field in SHAPE_FLAGS.values()
               if getattr(args, field) is not None})
            for preset in presets)
    except ValueError as error:
        fail(str(error))
    if zero_stage == 3:
        if args.compile == "block":
            fail("--compile block with ZeRO stage 3: ZeRO-3 gathers each module's parameters in "
                 "hooks that split a compiled encoder, whose TUPE terms then read the empty "
                 "placeholders they leave; use --compile none (ZeRO-3's default) or "
                 "--zero-stage 1 or 2")
        models = tuple(model.without_block() for model in models)
    if args.pp > models[0].num_layers:
        fail(f"--pp {args.pp}: --model {args.model} has {models[0].num_layers} layers, and every "
             "pipeline stage needs at least one; lower --pp")
    return models


def padded_vocab(data_dir: str, tp: int) -> int:
    """The tokenizer's vocabulary rounded up to a multiple of 128 x tp (as Megatron pads it)."""
    size = Tokenizer.from_file(os.path.join(data_dir, "tokenizer.json")).get_vocab_size()
    multiple = 128 * tp
    return -(-size // multiple) * multiple
