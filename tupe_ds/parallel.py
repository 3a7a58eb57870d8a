"""Process groups and devices: megatron-core's parallel_state, set up when nobody else did, and
taken down at the end of a command."""

import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
from megatron.core import parallel_state


def accelerator_device() -> torch.device:
    """The device of this process, as DeepSpeed's accelerator sees it (cuda:N, cpu, ...); without
    DeepSpeed (an exported model used for inference), the current CUDA device or the CPU."""
    try:
        from deepspeed.accelerator import get_accelerator  # slow import: only when a model is built
    except ImportError:
        return torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                            else "cpu")
    return torch.device(get_accelerator().current_device_name())


def ensure_model_parallel(tensor_parallel_size: int) -> None:
    """Make megatron-core's parallel state ready for `tensor_parallel_size`.

    In a plain process (a notebook, a test) this starts a one-process gloo group and tp=1 state.
    Under a launcher the caller initialises torch.distributed; the model-parallel groups are
    created here if they are not yet.
    """
    if not dist.is_initialized():
        if tensor_parallel_size != 1:
            raise RuntimeError(
                f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} processes: "
                "start them with torchrun or deepspeed and call torch.distributed.init_process_group "
                "before building the model"
            )
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            raise RuntimeError("launched with WORLD_SIZE > 1 but torch.distributed is not initialised")
        accelerator_device()  # imports DeepSpeed before the group exists: see end_distributed
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        current = parallel_state.get_tensor_model_parallel_world_size()
        if current != tensor_parallel_size:
            raise RuntimeError(
                f"megatron-core's parallel state has tensor_parallel_size={current}, but the model "
                f"asks for {tensor_parallel_size}; build the model with tensor_parallel_size={current}"
            )
        return
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise RuntimeError(
            f"world size {world} is not divisible by tensor_parallel_size={tensor_parallel_size}"
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size)


def end_distributed() -> None:
    """The last collective of a command, on every rank: wait until every rank is done, then
    destroy every process group while the interpreter is whole.

    Without it a rank that finishes first (the others still writing reports) exits while gloo's
    worker threads still hold its last collective's tensors: megatron-core and DeepSpeed keep the
    groups alive until interpreter finalization, where freeing those tensors takes the GIL and
    aborts the process ("terminate called without an active exception", exit -6; pytorch#190489).
    Releasing every reference here lets each group's destructor join its threads now. (DeepSpeed's
    comm module holds the world group in a default argument when it is imported after the group
    exists: import it first, as accelerator_device() does.)
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    parallel_state.destroy_model_parallel()
    for name, value in vars(parallel_state).items():  # what destroy_model_parallel leaves (0.16)
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    pipeline_p2p = sys.modules.get("deepspeed.runtime.pipe.p2p")
    if pipeline_p2p is not None:  # DeepSpeed's pipeline engine keeps its grid there (0.19)
        pipeline_p2p._grid, pipeline_p2p._groups, pipeline_p2p._async = None, None, []
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()  # also drops DeepSpeed's references to the groups
    else:
        dist.destroy_process_group()
    gc.collect()  # groups held only by reference cycles (engines, DDP) are destroyed now


def gather_tensor_parallel(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """The tensor-parallel ranks' shards of `tensor` joined along `dim`, differentiably.

    Written here because megatron-core's gather_from_tensor_model_parallel_region allocates its
    output on CUDA whatever the tensor's device.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return tensor
    return torch.cat(dist_nn.all_gather(tensor.contiguous(), group=group), dim=dim)


class MegatronMPU:
    """megatron-core's parallel_state under the names DeepSpeed asks an `mpu` for: its "model
    parallel" is our tensor parallelism, its data parallelism ours."""

    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(
        parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(
        parallel_state.get_tensor_model_parallel_src_rank)
    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)

    @staticmethod
    def get_data_parallel_group_ranks():
        return dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
