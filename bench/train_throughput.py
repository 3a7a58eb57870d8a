"""Training throughput under DeepSpeed: samples/s and achieved TFLOPS of a pretraining step.

    deepspeed --num_gpus 2 bench/train_throughput.py --model tiny --ds-config ds_configs/cpu_zero2.json
    deepspeed --num_gpus 8 bench/train_throughput.py --model bert-large --tp 2 \\
        --ds-config ds_configs/bert_large_fp16.json --seq-len 512

(`DS_ACCELERATOR=cpu` on a machine without a GPU.) The step is the one tupe_ds.pretrain runs:
DeepSpeed engine (ZeRO, precision and batch from the config), micro-batches with gradient
accumulation, on random full-length masked-LM batches so that only compute is measured. FLOPs are
Megatron's formula. On a CPU it also measures, in the same run, the FLOP/s of a plain fp32 matmul
on each rank and prints the fraction of it the training step achieves.
"""

import tupe_ds.tools.third_party_warnings  # noqa: F401  (first: filters import warnings)
import argparse
import json
import os
import statistics
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from megatron.core import parallel_state

from tupe_ds.distributed import launch
from tupe_ds.distributed.parallel import (MegatronMPU, accelerator_device, end_distributed,
                                          start_distributed)
from tupe_ds.machine.cuda_arch import fit_cuda_arch_list
from tupe_ds.model import ENCODINGS, PRESETS, ModelConfig, build_model
from tupe_ds.train.config import CPU_CONFIG
from tupe_ds.train.monitor import flops_per_step
from tupe_ds.train.optim import parameter_groups

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
p.add_argument("--pos-encoding", default="tupe-r", choices=list(ENCODINGS))
p.add_argument("--ds-config", default=CPU_CONFIG)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--seq-len", type=int, default=128)
p.add_argument("--micro-batch", type=int, default=8)
p.add_argument("--global-batch", type=int, help="default: micro-batch x data-parallel ranks")
p.add_argument("--vocab", type=int, default=32768)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
args = p.parse_args()

accelerator = get_accelerator()
accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # one GPU per process
device = accelerator_device()
launch.discover()
start_distributed("gloo" if device.type == "cpu" else accelerator.communication_backend_name())
parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
dp = dist.get_world_size() // args.tp

with open(args.ds_config) as f:
    ds_config = json.load(f)
ds_config["train_micro_batch_size_per_gpu"] = args.micro_batch
ds_config["train_batch_size"] = args.global_batch or args.micro_batch * dp
ds_config["gradient_accumulation_steps"] = ds_config["train_batch_size"] // (args.micro_batch * dp)
ds_config["steps_per_print"] = 10**9
dtype = ("bf16" if ds_config.get("bf16", {}).get("enabled") else
         "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32")
config = ModelConfig.from_preset(args.model, pos_encoding=args.pos_encoding, tensor_parallel_size=args.tp,
                                 vocab_size=args.vocab, seq_length=args.seq_len,
                                 max_position_embeddings=max(512, args.seq_len), dtype=dtype)
torch.manual_seed(0)
model = build_model(config)
arch_note = fit_cuda_arch_list()
if arch_note and dist.get_rank() == 0:
    print(arch_note)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.01),
                                       config=ds_config, mpu=MegatronMPU())

generator = torch.Generator().manual_seed(1)
ids = torch.randint(10, args.vocab, (args.micro_batch, args.seq_len), generator=generator).to(device)
mask = torch.ones_like(ids)
labels = ids.masked_fill(torch.rand(ids.shape, generator=generator).to(device) > 0.15, -100)


def step() -> float:
    accelerator.synchronize()
    start = time.perf_counter()
    for _ in range(engine.gradient_accumulation_steps()):
        loss, _ = engine(ids, mask, labels)
        engine.backward(loss)
        engine.step()
    accelerator.synchronize()
    return time.perf_counter() - start


def matmul_flops(n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)


times = [step() for _ in range(args.warmup + args.steps)][args.warmup:]
seconds = statistics.median(times)
global_batch = ds_config["train_batch_size"]
tflops = flops_per_step(config, global_batch, args.seq_len) / seconds / dist.get_world_size() / 1e12
line = (f"{args.model} {args.pos_encoding} {dtype}, {dist.get_world_size()} ranks (tp {args.tp}, "
        f"dp {dp}), global batch {global_batch} x {args.seq_len}, ZeRO "
        f"{ds_config.get('zero_optimization', {}).get('stage', 0)}: {seconds * 1e3:.1f} ms/step, "
        f"{global_batch / seconds:.1f} samples/s, {tflops:.4f} TFLOPS per rank")
if device.type == "cpu":
    dist.barrier()
    peak = matmul_flops()  # measured on every rank at once, as the ranks share the cores
    line += f", {tflops * 1e12 / peak:.1%} of a plain fp32 matmul ({peak / 1e9:.1f} GFLOP/s per rank)"
if dist.get_rank() == 0:
    print(f"device {accelerator.device_name()}, torch {torch.__version__}")
    print(line)
end_distributed()
