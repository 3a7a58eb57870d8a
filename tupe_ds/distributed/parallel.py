"""Process groups, devices and generators: megatron-core's parallel_state, set up when nobody else
did, and taken down at the end of a command; the tensor-parallel ranks' dropout generators. Also
what a rank waiting at the rendezvous says it waits for (`rendezvous_text`)."""

import contextlib
import gc
import glob
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import random as megatron_random

from tupe_ds.distributed.launch import processes_on_this_node


def accelerator_device() -> torch.device:
    """The device of this process, as DeepSpeed's accelerator sees it (cuda:N, cpu, ...); without
    DeepSpeed (an exported model used for inference), the current CUDA device or the CPU."""
    try:
        from deepspeed.accelerator import get_accelerator  # slow import: only when a model is built
    except ImportError:
        return torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available()
                            else "cpu")
    return torch.device(get_accelerator().current_device_name())


_ONE_PROCESS_VARIABLES = []  # what start_distributed set for a process without a launcher


def start_distributed(backend: str) -> None:
    """torch.distributed and DeepSpeed's communication for this process, as launch.discover() set
    RANK and WORLD_SIZE. One process gets an in-memory group: no port to collide with another run
    and no MPI discovery (DeepSpeed's, without launcher variables, imports mpi4py, which fails
    where no MPI library is installed, and takes port 29500 for every such run)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's CPU backend builds and loads its shared-memory all-reduce (deepspeed_shm_comm)
    # as the group starts, for inference_all_reduce (AutoTP inference) only, which training never
    # calls: building it took 2.5 minutes on a fresh machine, and each run left two 66 MB buffers
    # in /dev/shm. Marked incompatible (DeepSpeed keeps that dict for such edits), it is neither.
    shared_memory = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if shared_memory is not None:
        deepspeed.ops.__compatible_ops__[shared_memory.NAME] = False
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not dist.is_initialized():
        # this process's own variables (DeepSpeed's engine requires LOCAL_RANK), set here and
        # removed by end_distributed: a test or notebook that runs a command's main() in its own
        # process would otherwise pass them on to every process it starts later
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            if name not in os.environ:
                os.environ[name] = value
                _ONE_PROCESS_VARIABLES.append(name)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def rendezvous_text(world_size: int) -> str:
    if world_size == 1:
        return "the process group of this one process"
    return (f"the rendezvous of {world_size} processes at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} (MASTER_ADDR:MASTER_PORT): every process of the "
            "run must start")


def share_cpu_cores(environ=os.environ) -> None:
    """On the CPU, torch's threads of each process the launcher started on this machine: its share
    of the cores this process may run on, unless OMP_NUM_THREADS says. torchrun sets 1; the
    deepspeed launcher sets none, and each of its ranks took every core: 2 ranks of 2 threads on
    2 cores (`make demo`'s) stepped 1.5-1.9x slower (bench/README.md, "Threads per rank")."""
    if "OMP_NUM_THREADS" not in environ:
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // processes_on_this_node(environ)))


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the accelerator without waiting for it: a copy from pageable memory would
    block the host until the device has caught up."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


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
    exists: import it first, as accelerator_device() does.) Then removes the variables
    start_distributed set for one process.
    """
    while _ONE_PROCESS_VARIABLES:
        os.environ.pop(_ONE_PROCESS_VARIABLES.pop(), None)
    if not dist.is_initialized():
        return
    dist.barrier()
    parallel_state.destroy_model_parallel()
    for name, value in vars(parallel_state).items():  # what destroy_model_parallel leaves (0.16)
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # a compiled encoder's graphs hold the groups they were traced with
        dynamo.reset()
    rotary = sys.modules.get("megatron.core.models.common.embeddings.rotary_pos_embedding")
    if rotary is not None:  # its forward's lru_cache holds the modules, and through them a group
        rotary.RotaryEmbedding.forward.cache_clear()
    pipeline_p2p = sys.modules.get("deepspeed.runtime.pipe.p2p")
    if pipeline_p2p is not None:  # DeepSpeed's pipeline engine keeps its grid there (0.19)
        pipeline_p2p._grid, pipeline_p2p._groups, pipeline_p2p._async = None, None, []
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()  # also drops DeepSpeed's references to the groups
    else:
        dist.destroy_process_group()
    # groups held only by reference cycles (engines, DDP) are destroyed now; what one pass frees
    # can release more (a compiled pipeline stage's graphs: 406 objects in a second pass)
    for _ in range(3):
        if not gc.collect():
            break
    deadline = time.monotonic() + 5
    while gloo_threads() and time.monotonic() < deadline:  # a destroyed group's transport
        time.sleep(0.01)  # threads end on their own, shortly after (seen: one left, 1 run in 4)


def gloo_threads() -> int:
    """Threads of this process that belong to a live gloo process group (Linux: /proc)."""
    names = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(comm) as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


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


class AcceleratorRNGTracker(megatron_random.CudaRNGStatesTracker):
    """megatron-core's tracker of named generator states, over the accelerator's default generator.

    Written here because megatron-core's CudaRNGStatesTracker saves and restores CUDA states only
    (torch.cuda calls): this is the same bookkeeping on the device's default torch generator
    (default_generator), so a CPU runs the code a GPU runs, with or without DeepSpeed.
    """

    def add(self, name: str, seed: int) -> None:
        if name in self.states_ or seed in self.seeds_:
            raise ValueError(f"generator state {name!r} or seed {seed} is already tracked")
        generator = default_generator()
        outside = generator.get_state()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()
        generator.set_state(outside)
        self.seeds_.add(seed)
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        generator = default_generator()
        outside = generator.get_state()
        generator.set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = generator.get_state()
            generator.set_state(outside)


def default_generator() -> torch.Generator:
    """The generator dropout draws from on this process's device (torch.cuda.default_generators
    on CUDA, torch.default_generator on a CPU), with or without DeepSpeed."""
    device = accelerator_device()
    if device.type == "cpu":
        return torch.default_generator
    return torch.get_device_module(device.type).default_generators[device.index or 0]


TENSOR_PARALLEL_SEED_OFFSET = 2718  # megatron-core's model_parallel_cuda_manual_seed's


def seed_tensor_parallel_rng(seed: int, tp_rank: Optional[int] = None) -> None:
    """Megatron's seeding of dropout inside the tensor-parallel region (megatron-core's
    model_parallel_cuda_manual_seed): the tracker's state is seed + 2718 + tp rank, so each rank
    draws its own heads' attention dropout. Dropout of replicated activations (hidden states) uses
    the default generator, which the caller seeds alike on every tensor-parallel rank
    (torch.manual_seed(seed), as Megatron does)."""
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker = AcceleratorRNGTracker()
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
                (seed + TENSOR_PARALLEL_SEED_OFFSET + tp_rank) % 2**63)
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker  # megatron-core's own slot for it
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def tensor_parallel_rng():
    """The context in which this rank draws dropout for its own heads (tensor parallelism)."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if tracker.is_initialized():
        return tracker.fork()
    raise RuntimeError("dropout under tensor parallelism needs a generator per tensor-parallel "
                       "rank: build the model with tupe_ds.build_model, or call "
                       "tupe_ds.distributed.parallel.seed_tensor_parallel_rng(seed) "
                       "before training")
