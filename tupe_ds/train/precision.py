"""--bf16: the --ds-config trained in bf16 in place of its precision, refused where a GPU lacks
bf16; and, for a run in fp16 whose GPUs all have bf16, the line that says it is one flag away.

fp16 stays the shipped precision (its configs run on every GPU from compute capability 6.0).
bf16 has fp32's range: DeepSpeed scales no loss, so no step is skipped while the fp16 scaler
looks for its scale (from 2^16 at the start, and after each overflow). The overflow check at the
optimizer boundary stays in bf16: DeepSpeed's `bf16.check_grad_overflow` is on by default and
tupe_ds keeps it on (nonfinite.config_problem), so that a step with a NaN is skipped; it costs
the same in both (optimizer_boundary.py counts it).
"""

from typing import Optional, Sequence

import logging
import torch.distributed as dist

from tupe_ds.machine import doctor

logger = logging.getLogger(__name__)


def with_bf16(ds_config: dict) -> dict:
    """`ds_config` with bf16 in place of its precision (fp16 and torch autocast's amp removed)."""
    config = {key: value for key, value in ds_config.items() if key not in ("fp16", "amp")}
    config["bf16"] = {**ds_config.get("bf16", {}), "enabled": True}
    return config


def bf16_refusal(machine: doctor.Machine) -> Optional[str]:
    """Why --bf16 cannot train on `machine`; None where it can (GPUs that all have bf16, or
    DeepSpeed's CPU accelerator), or where no GPU is visible to say so (doctor's environment
    findings do)."""
    if machine.supports("bf16") or (machine.accelerator == "cuda" and not machine.capabilities):
        return None
    need = doctor.BF16_CAPABILITY
    capabilities = ", ".join(f"{a}.{b}" for a, b in sorted(set(machine.capabilities)))
    return (f"--bf16: bf16 needs GPUs of compute capability {need[0]}.{need[1]} or newer (A100, "
            f"H100, H200); these have {capabilities}: leave --bf16 out (the --ds-config's "
            "precision runs here)")


def bf16_advice(machines: Sequence[doctor.Machine], dtype: str) -> Optional[str]:
    """The line a run in fp16 says where every GPU of `machines` (the run's) has bf16; None
    otherwise."""
    if dtype != "fp16" or not machines or any(m.half_precision != "bf16" for m in machines):
        return None
    return ("tupe-pretrain: every GPU of this run has bf16: --bf16 trains this config in bf16, "
            "with no loss scaling, so no step is skipped for an fp16 overflow (the fp16 scaler "
            "starts at 2^16 and skips each step that overflows it while it lowers the scale); "
            "the overflow check before each step stays, as in fp16. Speed on these GPUs: not "
            "measured")


def of_run(ds_config: dict) -> str:
    """The run's precision (doctor.precision). Collective: in fp16 where every rank's GPU has
    bf16 (each rank probes its own), it first says the line that says so (bf16_advice)."""
    dtype = doctor.precision(ds_config)
    if dtype == "fp16":
        machines = [None] * dist.get_world_size()
        dist.all_gather_object(machines, doctor.probe())
        advice = bf16_advice(machines, dtype)
        if advice:
            logger.info(advice)
    return dtype
