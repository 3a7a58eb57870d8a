"""tupe-doctor: what this machine is to tupe_ds, and what will stop a run on it, before any run.

    tupe-doctor                                       # the machine and its environment
    tupe-doctor --ds-config ds_configs/bert_large_fp16.json --nproc 8
    tupe-doctor --slurm --data DATA --out RUN_DIR     # inside a Slurm allocation

Prints the accelerator, its GPUs and the libraries' versions, then each finding (the
*_findings checks below; with --slurm, cluster_check.py's across the job's nodes) with what to
change; `tupe-pretrain --check-only` prints the same. Exit code 1 when a finding would stop the
run.
"""

from tupe_ds.tools import startup  # noqa: F401  (first: the collector paused while they import)
from tupe_ds.tools.third_party_warnings import add_verbose_flag  # filters import warnings
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from importlib import metadata

from tupe_ds.machine.cluster_check import Finding, slurm_report
from tupe_ds.machine.cuda_arch import VARIABLE as ARCH_LIST, deepspeed_arch_list
from tupe_ds.machine.extension_locks import extension_locks, is_stale, lock_text
from tupe_ds.tools import command_line, entry
from tupe_ds.tools.errors import CommandRefused, NotRegularFile
from tupe_ds.tools.files import regular_file
from tupe_ds.tools.lock import file_kind

BF16_CAPABILITY = (8, 0)  # Ampere: bf16 tensor cores
FP16_CAPABILITY = (6, 0)  # Pascal P100 and newer: native fp16 arithmetic
CPU_CONFIG = "ds_configs/cpu_zero2.json"


@dataclass(frozen=True)
class Machine:
    accelerator: str  # what DeepSpeed will run on: "cuda" or "cpu"
    gpus: int  # CUDA devices this process sees
    capabilities: tuple = ()  # (major, minor) of each GPU
    versions: dict = field(default_factory=dict)

    def supports(self, dtype: str) -> bool:
        if dtype == "fp32":
            return True
        if self.accelerator != "cuda":
            return dtype == "bf16"  # DeepSpeed's CPU accelerator trains bf16, refuses fp16
        if not self.capabilities:
            return False
        need = BF16_CAPABILITY if dtype == "bf16" else FP16_CAPABILITY
        return all(capability >= need for capability in self.capabilities)

    @property
    def half_precision(self):
        """The half precision to train in here: bf16 where every GPU has it, else fp16, else
        None (a CPU, or GPUs older than FP16_CAPABILITY)."""
        if self.accelerator != "cuda" or not self.gpus:
            return None
        return next((dtype for dtype in ("bf16", "fp16") if self.supports(dtype)), None)


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def probe(environ=os.environ) -> Machine:
    """This machine, as torch and DeepSpeed see it (no process group, no model)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    capabilities = tuple(torch.cuda.get_device_capability(i) for i in range(gpus))
    accelerator = environ.get("DS_ACCELERATOR") or ("cuda" if gpus else "cpu")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus else "-"
    versions = {"torch": torch.__version__, "CUDA": torch.version.cuda or "-", "NCCL": nccl,
                "deepspeed": version("deepspeed"), "megatron-core": version("megatron-core")}
    return Machine(accelerator=accelerator, gpus=gpus, capabilities=capabilities,
                   versions=versions)


def precision(ds_config: dict) -> str:
    """The training dtype a DeepSpeed config asks for: bf16, fp16 or fp32."""
    return next((d for d in ("bf16", "fp16") if ds_config.get(d, {}).get("enabled")), "fp32")


def precision_findings(ds_config: dict, path: str, machine: Machine) -> list:
    dtype = precision(ds_config)
    if machine.supports(dtype):
        return []
    if machine.accelerator != "cuda":
        return [Finding(True, f"{path} enables {dtype}, which DeepSpeed refuses without CUDA; on "
                              f"a CPU use {CPU_CONFIG} (fp32) or enable bf16 instead")]
    better = machine.half_precision or "fp32"
    need = BF16_CAPABILITY if dtype == "bf16" else FP16_CAPABILITY
    capabilities = ", ".join(f"{a}.{b}" for a, b in sorted(set(machine.capabilities)))
    return [Finding(True, f"{path} enables {dtype}, which needs GPUs of compute capability "
                          f"{need[0]}.{need[1]} or newer; these have {capabilities}: set "
                          f'"{dtype}": {{"enabled": false}} and ' +
                    ("train in fp32" if better == "fp32" else f'"{better}": {{"enabled": true}}')
                    + (" (ds_configs/*_fp16.json are the fp16 configs)" if better == "fp16"
                       else ""))]


def optimizer_findings(ds_config: dict, path: str, machine: Machine, environ=os.environ) -> list:
    """DeepSpeed's own Adam/AdamW/Lamb on a GPU is an extension compiled on first use: it needs
    nvcc (CUDA_HOME) and takes about a minute; torch's fused AdamW needs neither."""
    optimizer = ds_config.get("optimizer", {})
    kind, params = optimizer.get("type", "").lower(), optimizer.get("params", {})
    compiled = (kind in ("adam", "adamw") and not params.get("torch_adam")) or kind in (
        "lamb", "onebitadam", "onebitlamb", "zerooneadam")
    if machine.accelerator != "cuda" or not compiled:
        return []
    has_nvcc = shutil.which("nvcc") or os.path.exists(
        os.path.join(environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))
    if has_nvcc:
        return [Finding(False, f"{path}: optimizer {optimizer['type']} is compiled by DeepSpeed "
                               "on first use (about a minute per fresh machine); "
                               '"torch_adam": true, "fused": true in its params avoids it')]
    return [Finding(True, f"{path}: optimizer {optimizer['type']} is a DeepSpeed extension "
                          "compiled on first use, and there is no nvcc here (CUDA_HOME); add "
                          '"torch_adam": true, "fused": true to its params (torch\'s fused AdamW, '
                          "as in the shipped configs)")]


def launch_findings(processes_here: int, machine: Machine) -> list:
    """More processes on this machine than GPUs: the extra ranks would have no device."""
    if machine.accelerator != "cuda" or processes_here <= machine.gpus:
        return []
    return [Finding(True, f"{processes_here} processes on this machine, but it has "
                          f"{machine.gpus} GPU(s): start {machine.gpus} (deepspeed --num_gpus "
                          f"{machine.gpus}, torchrun --nproc_per_node {machine.gpus}, or one "
                          "Slurm task per GPU)")]


def environment_findings(environ, machine: Machine) -> list:
    found = []
    value = environ.get(ARCH_LIST)
    if value is not None and deepspeed_arch_list(value) != value:
        found.append(Finding(False, f"{ARCH_LIST}={value!r}: DeepSpeed's extension builder cannot "
                                    "parse arch letters; tupe-pretrain rewrites it to "
                                    f"{deepspeed_arch_list(value)!r} for itself, other DeepSpeed "
                                    f"tools need export {ARCH_LIST}="
                                    f"'{deepspeed_arch_list(value)}'"))
    if environ.get("CUDA_VISIBLE_DEVICES") == "" and machine.gpus == 0:
        found.append(Finding(False, "CUDA_VISIBLE_DEVICES is set but empty: this process sees "
                                    "no GPU; unset it (or list the GPUs) to train on them"))
    if environ.get("DS_ACCELERATOR") == "cpu" and machine.gpus:
        found.append(Finding(False, f"DS_ACCELERATOR=cpu while {machine.gpus} GPU(s) are here: "
                                    "DeepSpeed will train on the CPU; unset DS_ACCELERATOR"))
    if machine.accelerator == "cuda" and machine.gpus == 0:
        found.append(Finding(True, "DS_ACCELERATOR=cuda but torch sees no GPU (a CPU build of "
                                   "torch, or no driver): install the CUDA build of torch, or "
                                   "unset DS_ACCELERATOR to run on the CPU"))
    return found


def extension_lock_findings(environ=os.environ) -> list:
    """A lock of torch's extension builder that no live build holds makes every later run wait
    forever, in silence: fatal once known to be stale (older than STALE_LOCK_SECONDS, on a
    filesystem where every holder would show), else a warning that says what cannot be seen."""
    return [Finding(is_stale(*lock[1:]), lock_text(*lock)) for lock in extension_locks(environ)]


def describe(machine: Machine) -> str:
    if machine.gpus:
        capabilities = ", ".join(f"{a}.{b}" for a, b in machine.capabilities)
        devices = f"{machine.gpus} GPU(s), compute capability {capabilities}"
    else:
        devices = "no GPU"
    versions = ", ".join(f"{name} {value}" for name, value in machine.versions.items())
    half = machine.half_precision or "none (fp32, or bf16 on a CPU)"
    return (f"accelerator {machine.accelerator}: {devices}; half precision here: {half}\n"
            f"{versions}")


def report(machine: Machine, findings: list) -> str:
    lines = [describe(machine)]
    if not findings:
        lines.append("no problem found")
    lines += [f"{'ERROR' if f.fatal else 'warning'}: {f.text}" for f in findings]
    return "\n".join(lines)


SECTIONS = ("optimizer", "scheduler", "zero_optimization", "fp16", "bf16", "checkpoint",
            "tensorboard")  # those tupe_ds reads: each a JSON object where given


def read_ds_config(path: str) -> dict:
    """The DeepSpeed config at `path`; CommandRefused naming the file and what is wrong with it
    (missing, not a regular file, not UTF-8 JSON, not an object, a section or its params that is
    not one, a number that is NaN or infinite)."""
    try:
        with open(regular_file(path), encoding="utf-8") as f:  # a FIFO would hang the read
            config = json.load(f)
    except FileNotFoundError:
        raise CommandRefused(f"--ds-config {path}: no such file") from None
    except json.JSONDecodeError as error:
        raise CommandRefused(f"--ds-config {path}: invalid JSON at line {error.lineno}: "
                             f"{error.msg}") from None
    except NotRegularFile:
        raise CommandRefused(f"--ds-config {path}: {file_kind(os.stat(path).st_mode)}, not a "
                             "file: give a DeepSpeed config (JSON)") from None
    except (OSError, UnicodeDecodeError, RecursionError) as error:
        raise CommandRefused(f"--ds-config {path}: not readable as a JSON file "
                             f"({getattr(error, 'strerror', None) or error})") from None
    if not isinstance(config, dict):
        raise CommandRefused(f"--ds-config {path}: a DeepSpeed config is a JSON object "
                             f"({{...}}), not {json.dumps(config)[:40]}")
    for section in (s for s in SECTIONS if s in config):
        value = config[section]
        wrong = (section, value) if not isinstance(value, dict) else \
            (f"{section}.params", value["params"]) if not isinstance(
                value.get("params", {}), dict) else None
        if wrong:
            raise CommandRefused(f"--ds-config {path}: \"{wrong[0]}\" is "
                                 f"{json.dumps(wrong[1])[:40]}, not an object ({{...}})")
    if bad := next(not_finite(config), None):
        raise CommandRefused(f"--ds-config {path}: \"{bad}\" is not a finite number")
    return config


def not_finite(value, where: str = ""):
    """The dotted names of the NaN and infinite numbers in a JSON value (Python's json reads
    NaN and Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        yield where
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from not_finite(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from not_finite(item, f"{where}[{index}]")


def all_findings(machine: Machine, ds_config_path=None, processes_here=None,
                 environ=os.environ, ds_config=None) -> list:
    """Every finding; the DeepSpeed config is read from `ds_config_path` unless already given
    as `ds_config`."""
    findings = environment_findings(environ, machine) + extension_lock_findings(environ)
    if ds_config_path:
        if ds_config is None:
            ds_config = read_ds_config(ds_config_path)
        findings += precision_findings(ds_config, ds_config_path, machine)
        findings += optimizer_findings(ds_config, ds_config_path, machine, environ)
    if processes_here:
        findings += launch_findings(processes_here, machine)
    return findings


def main(argv=None) -> int:
    return entry.run("tupe-doctor", lambda: check_machine(argv))


def check_machine(argv) -> int:
    """tupe-doctor's work: this machine probed and checked (with --slurm, the job's nodes too),
    the report said; 1 where a finding is fatal."""
    p = command_line.Parser(prog="tupe-doctor", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    command_line.add_config_flags(p)
    add_verbose_flag(p)
    p.add_argument("--ds-config", help="a DeepSpeed config to check against this machine")
    p.add_argument("--nproc", type=command_line.positive,
                   help="processes to start on this machine")
    p.add_argument("--slurm", action="store_true",
                   help="inside a Slurm allocation: what the job's ranks will use, and what will "
                        "go wrong across its nodes")
    p.add_argument("--data", help="with --slurm: the job's --data folder")
    p.add_argument("--out", help="with --slurm: the job's --out folder")
    command_line.paths(p, "ds_config", "data", "out")
    args = command_line.parse(p, argv)
    machine = probe()
    try:
        findings = all_findings(machine, args.ds_config, args.nproc)
    except (OSError, json.JSONDecodeError) as error:  # here only: --ds-config's read
        raise CommandRefused(f"--ds-config {args.ds_config}: {error}") from None
    if args.slurm:
        backend = "nccl" if machine.accelerator == "cuda" and machine.gpus else "gloo"
        lines, slurm_findings = slurm_report(os.environ, backend, args.data, args.out)
        print("\n".join(["slurm:", *(f"  {line}" for line in lines)]))
        findings += slurm_findings
    print(report(machine, findings))
    return 1 if any(f.fatal for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
