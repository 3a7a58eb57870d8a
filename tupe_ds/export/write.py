"""tupe-export: a pretraining checkpoint as one fp32 model that transformers and tupe_ds load.

    tupe-export runs/large/checkpoints --out exported/large           # its newest checkpoint
    tupe-export runs/large/checkpoints/step100000 --out exported/large-100k
    tupe-export runs/electra --out exported/electra-gen --electra-network generator

RUN_DIR/run.json (written by tupe-pretrain) says which model and layout the checkpoint holds.
The checkpoint's files are checked first (the manifest's sizes and checksums, no file it does
not list, every pickle read with weights_only: tupe_ds/train/checkpoint/safe_load.py), and
DeepSpeed's zero_to_fp32, which asks for weights_only=False, reads them with weights_only all
the same (safe_load.weights_only_loads).
Each model-parallel slice (tensor-parallel rank x pipeline stage) becomes an fp32 state dict,
its pipeline names mapped back to BertForMaskedLM's and the tensor-parallel shards joined
(consolidate.py). DIR is written in one of FORMATS (formats.py). ELECTRA runs export the
discriminator (the network to fine-tune) or, for transformers, the generator.

`load_exported(DIR)` builds the model from a folder of either format (tp=1; DeepSpeed need not be
installed).
"""

from tupe_ds.tools import startup  # noqa: F401  (first: the collector paused while they import)
from tupe_ds.tools.errors import ExportError
from tupe_ds.tools.third_party_warnings import add_verbose_flag  # filters import warnings
import logging
import os
import sys
from typing import Optional

from tupe_ds.distributed.parallel import end_distributed
from tupe_ds.export.consolidate import consolidated_state, files_named, network_state
from tupe_ds.export.formats import FORMATS, check_out, save_exported
from tupe_ds.tools import command_line, entry
from tupe_ds.tools.files import file_digest
from tupe_ds.train.run_folder import description as folder_description
from tupe_ds.train.checkpoint import manifest, safe_load
from tupe_ds.train.checkpoint.folder import latest_step, survey, tag_of
from tupe_ds.train.checkpoint.reshard import saved_layout

logger = logging.getLogger(__name__)


def find_checkpoint(path: str) -> tuple:
    """(run folder, checkpoint folder) from RUN_DIR, RUN_DIR/checkpoints (its newest complete
    checkpoint of the run's own lineage, as run.json names it) or RUN_DIR/checkpoints/stepN."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if not os.path.basename(path).startswith("step"):
        own = folder_description.lineage(os.path.dirname(path))
        complete = survey(path)[0]
        ours = [step for step, record in complete.items() if own in (None, record["lineage"])]
        newest = max(ours) if ours else latest_step(path)
        if newest:
            path = os.path.join(path, tag_of(newest))
    if not files_named(path, "*mp_rank_*_model_states.pt"):
        raise ExportError(f"{path}: not a complete DeepSpeed checkpoint (no mp_rank_*_model_states.pt);"
                          " give RUN_DIR/checkpoints (its newest) or RUN_DIR/checkpoints/stepN")
    return os.path.dirname(os.path.dirname(path)), path


def read_manifest(step_dir: str) -> Optional[dict]:
    """The checkpoint's manifest; None for a checkpoint of an earlier version, which has none."""
    if not manifest.exists(step_dir):
        return None
    try:
        return manifest.read(step_dir)
    except ValueError as error:
        raise ExportError(str(error)) from None


def check_files(step_dir: str, record: Optional[dict]) -> None:
    """Before DeepSpeed's zero_to_fp32 unpickles anything: the manifest's (`record`'s) sizes and
    checksums, and every .pt read with weights_only (a checkpoint of an earlier version, without
    a manifest, only the latter)."""
    if record is not None:
        files = record["files"]
        problems = manifest.check_files(step_dir, files) + manifest.unlisted(step_dir, files)
    else:
        files = files_named(step_dir, "*.pt")
        problems = [problem for problem in map(safe_load.scan, files) if problem]
    if problems:
        raise ExportError("; ".join(problems))


def export(checkpoint: str, out: str, format: str = "hf", network: str = "discriminator",
           tokenizer: Optional[str] = None) -> str:
    """`out` in FORMATS[format] from a checkpoint; ELECTRA runs export `network`. The tokenizer
    is `tokenizer`, else the run's (run.json's data folder), checked against the vocabulary the
    checkpoint's manifest records."""
    check_out(out)
    run_dir, step_dir = find_checkpoint(checkpoint)
    try:
        run = folder_description.read(run_dir)
    except ValueError as error:
        raise ExportError(str(error)) from None
    electra = run["objective"] == "electra"
    if network != "discriminator" and not (electra and format == "hf"):
        raise ExportError(f"--electra-network {network}: only an ELECTRA run's generator, in "
                          "--format hf, can be exported; leave the flag out")
    tokenizer = tokenizer or os.path.join(run["data"], "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise ExportError(f"{tokenizer}: no tokenizer there (run.json's data folder); give the "
                          "one the run was trained with: --tokenizer PATH")
    record = read_manifest(step_dir)
    masking = None  # a checkpoint of an earlier version records none
    if record is not None:  # run.json says the layout of the run's last start
        vocabulary = record["identity"].get("vocabulary")
        if vocabulary is not None and file_digest(tokenizer) != vocabulary:
            raise ExportError(f"{tokenizer} is not the tokenizer {step_dir} was trained with (its "
                              "manifest records another vocabulary); give that one: --tokenizer "
                              "PATH")
        try:
            layout = saved_layout(record)
        except ValueError as error:
            raise ExportError(str(error)) from None
        run = {**run, "tp": layout.tp, "pp": layout.pp}
        masking = record["identity"].get("masking")
    with safe_load.weights_only_loads():  # zero_to_fp32's loads included
        check_files(step_dir, record)
        configs, state = consolidated_state(run, step_dir)
    state = network_state(state, network if electra else None)
    if format == "tupe":  # a BertForMaskedLM's parameters only, as earlier versions read
        state = {n: t for n, t in state.items() if not n.startswith("discriminator_head.")}
    config = configs[1] if network == "generator" else configs[0]
    save_exported(out, state, config, f"electra-{network}" if electra else "bert-mlm",
                  tokenizer, source=step_dir, format=format,
                  embedding_size=configs[0].hidden_size, masking=masking)
    return step_dir


def main(argv=None) -> int:
    return entry.run("tupe-export", lambda: export_command(argv), errors=(ExportError,))


def export_command(argv) -> int:
    """tupe-export's work: the checkpoint written as --out (export), and what it holds said."""
    p = command_line.Parser(prog="tupe-export", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    command_line.add_config_flags(p)
    add_verbose_flag(p)
    p.add_argument("checkpoint", help="RUN_DIR, RUN_DIR/checkpoints (its newest) or .../stepN")
    p.add_argument("--out", required=True,
                   help="folder to write: a new one, or an earlier export, which is replaced "
                        "when the new one is complete")
    p.add_argument("--format", choices=FORMATS, default="hf",
                   help="; ".join(f"{name}: {text}" for name, text in FORMATS.items()))
    p.add_argument("--tokenizer", metavar="PATH",
                   help="the tokenizer.json the run was trained with (default: the one in "
                        "run.json's data folder); checked against the checkpoint's manifest")
    p.add_argument("--electra-network", choices=["discriminator", "generator"],
                   default="discriminator", help="the ELECTRA network to export (generator: hf)")
    command_line.paths(p, "out", "tokenizer")
    args = command_line.parse(p, argv)
    # reads.Unreadable: the filesystem, not the checkpoint; nothing was written (entry.run, exit 3)
    step_dir = export(args.checkpoint, args.out, args.format, args.electra_network, args.tokenizer)
    logger.info(f"exported {step_dir} -> {args.out} ({', '.join(sorted(os.listdir(args.out)))})")
    end_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
