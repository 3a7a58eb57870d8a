"""Process groups and devices: megatron-core's parallel_state, set up when nobody else did."""

import os

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
