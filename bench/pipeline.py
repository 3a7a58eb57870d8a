"""Pipeline parallelism: pp=2 against pp=1 step time, bytes between stages, and what the positional
term would cost sent from the first stage instead of recomputed on each.

    deepspeed --num_gpus 2 bench/pipeline.py                       # CPU: DS_ACCELERATOR=cpu
    deepspeed --num_gpus 2 bench/pipeline.py --model bert-large --seq-len 512 --micro-batch 1

(`DS_ACCELERATOR=cpu` on a machine without a GPU; make bench runs the first line.) On the same 2
ranks and the same global batch, one run measures:
- the training step of tupe_ds.pretrain with pp=1 (2 data-parallel ranks) and with pp=2 (2
  stages, DeepSpeed's pipeline engine), ZeRO stage 1, random full-length masked-LM batches;
- the bytes DeepSpeed's pipeline engine sends between the stages per micro-batch (its p2p.send
  calls, counted);
- one stage's positional term (forward + backward, [heads, n, n]) against sending that tensor from
  one rank to the other and its gradient back: the two ways of sharing it across stages.
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
from deepspeed.runtime.pipe import p2p
from megatron.core import parallel_state

from tupe_ds.distributed import launch
from tupe_ds.distributed.parallel import (MegatronMPU, accelerator_device, end_distributed,
                                          start_distributed)
from tupe_ds.model import ENCODINGS, PRESETS, ModelConfig, build_model
from tupe_ds.model.pipeline import BertPipeline, pipeline_topology
from tupe_ds.model.positional import PositionalEncoding
from tupe_ds.train.config import CPU_CONFIG
from tupe_ds.train.normalization import PER_TOKEN, LossNormalization
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train.optim import parameter_groups
from tupe_ds.train.steps import EngineSteps, PipelineLoss, PipelineSteps

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--model", default="bert-base", choices=sorted(PRESETS))
p.add_argument("--pos-encoding", default="tupe-r",
               choices=[name for name, e in ENCODINGS.items() if e.has_positional_logits])
p.add_argument("--ds-config", default=CPU_CONFIG, help="its ZeRO stage is set to 1")
p.add_argument("--seq-len", type=int, default=128)
p.add_argument("--micro-batch", type=int, default=4)
p.add_argument("--micro-batches", type=int, default=4, help="per optimizer step (pp=2)")
p.add_argument("--vocab", type=int, default=32768)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--warmup", type=int, default=1)
p.add_argument("--positional-only", action="store_true",
               help="only the positional term against sending it (no training steps: BERT-Large "
                    "training does not fit two CPU ranks in 24 GB)")
p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
args = p.parse_args()

accelerator = get_accelerator()
accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
device = accelerator_device()
launch.discover()
start_distributed("gloo" if device.type == "cpu" else accelerator.communication_backend_name())
if dist.get_world_size() != 2:
    raise SystemExit("run it with 2 processes: deepspeed --num_gpus 2 bench/pipeline.py")
rank = dist.get_rank()

with open(args.ds_config) as f:
    ds_config = json.load(f)
ds_config.update(train_micro_batch_size_per_gpu=args.micro_batch, steps_per_print=10**9,
                 train_batch_size=args.micro_batch * args.micro_batches)
ds_config["zero_optimization"] = {"stage": 1}
dtype = ("bf16" if ds_config.get("bf16", {}).get("enabled") else
         "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32")
config = ModelConfig.from_preset(args.model, pos_encoding=args.pos_encoding, vocab_size=args.vocab,
                                 seq_length=args.seq_len, dtype=dtype,
                                 max_position_embeddings=max(512, args.seq_len))
objective = OBJECTIVES["mlm"]
normalization = LossNormalization(PER_TOKEN, objective, device)

generator = torch.Generator().manual_seed(1)
ids = torch.randint(10, args.vocab, (args.micro_batch, args.seq_len), generator=generator)
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
         "labels": ids.masked_fill(torch.rand(ids.shape, generator=generator) > 0.15, -100)}


def timed_steps(steps, micro_batches: int) -> list:
    times = []
    for _ in range(args.warmup + args.steps):
        accelerator.synchronize()
        start = time.perf_counter()
        steps.train([batch] * micro_batches, {})
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return times[args.warmup:]


def data_parallel_step() -> float:
    torch.manual_seed(0)
    model = build_model(config)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameter_groups(model, 0.01),
        config={**ds_config, "gradient_accumulation_steps": args.micro_batches // 2},
        mpu=MegatronMPU())
    seconds = statistics.median(timed_steps(EngineSteps(engine, objective, normalization, device),
                                            args.micro_batches // 2))
    parallel_state.destroy_model_parallel()
    return seconds


sent = {"bytes": 0}
send = p2p.send


def counting_send(tensor, dest_stage, async_op=False):
    sent["bytes"] += tensor.numel() * tensor.element_size()
    return send(tensor, dest_stage, async_op)


def pipeline_step():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(0)
    loss = PipelineLoss(objective)
    model = BertPipeline(config, pipeline_topology(2, 1, 1), loss)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameter_groups(model, 0.01),
        config={**ds_config, "gradient_accumulation_steps": args.micro_batches})
    steps = PipelineSteps(engine, loss, normalization, device)
    timed_steps(steps, args.micro_batches)  # the first step also sends the tensors' shapes
    p2p.send = counting_send
    times = timed_steps(steps, args.micro_batches)
    p2p.send = send
    total = torch.tensor([float(sent["bytes"])])
    dist.all_reduce(total)  # stage 0 sent the activations, stage 1 their gradients
    per_micro_batch = total.item() / (args.warmup + args.steps) / args.micro_batches
    positional = model.tied_modules["positional"]
    tied = sum(param.numel() * param.element_size() for param in positional.parameters())
    parallel_state.destroy_model_parallel()
    return statistics.median(times), per_micro_batch, model.stage_layers, tied


def positional_seconds(repeats: int = 5) -> float:
    """One stage's content-free logits v (forward + backward): what sending v would save it.

    Building the attention mask from v and the padding is left out: every stage does that in
    either design."""
    module = PositionalEncoding(config, config.transformer_config()).to(device)
    times = []
    for _ in range(repeats + 1):
        accelerator.synchronize()
        start = time.perf_counter()
        module.content_free_logits(args.seq_len).sum().backward()
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def send_seconds(shape, repeats: int = 5) -> float:
    """Rank 0 sends a float32 tensor of `shape` to rank 1, which sends one back (the gradient)."""
    tensor = torch.zeros(shape, device=device)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


parallel_state.initialize_model_parallel()
heads, n = config.num_attention_heads, args.seq_len
recompute = positional_seconds()  # both ranks at once, as both stages do
send_v = send_seconds((heads, n, n))
if not args.positional_only:
    pp1 = data_parallel_step()
    pp2, per_micro_batch, stage_layers, tied_bytes = pipeline_step()
v_bytes = 2 * heads * n * n * 4  # v in fp32 forward, its gradient backward
hidden_bytes = n * args.micro_batch * config.hidden_size * torch.finfo(
    config.transformer_config().params_dtype).bits // 8
MiB = 2**20
if rank == 0:
    print(f"device {accelerator.device_name()}, torch {torch.__version__}")
    print(f"{args.model} {args.pos_encoding} {dtype}, 2 ranks, global batch "
          f"{args.micro_batch * args.micro_batches} ({args.micro_batches} micro-batches of "
          f"{args.micro_batch}) x {n}, ZeRO 1")
    if not args.positional_only:
        print(f"  pp=1 (dp 2):  {pp1 * 1e3:.0f} ms/step")
        print(f"  pp=2 (dp 1):  {pp2 * 1e3:.0f} ms/step ({pp2 / pp1:.2f}x pp=1), layers per stage "
              f"{stage_layers}")
        print(f"  sent between the stages per micro-batch: {per_micro_batch / MiB:.2f} MiB "
              f"(hidden states [n, b, h] forward and their gradient back: "
              f"{2 * hidden_bytes / MiB:.2f} MiB, + the attention mask)")
    print(f"positional term of one stage per micro-batch (v: [{heads}, {n}, {n}]):")
    share = "" if args.positional_only else f", {recompute * args.micro_batches / pp2:.1%} of the pp=2 step"
    print(f"  recomputed on the stage (forward + backward): {recompute * 1e3:.2f} ms{share}")
    print(f"  sent instead (v and its gradient, fp32): {v_bytes / MiB:.2f} MiB more per "
          f"micro-batch and stage boundary ({v_bytes / (2 * hidden_bytes):.1f}x the hidden "
          f"states), {send_v * 1e3:.2f} ms point to point here")
    if not args.positional_only:
        print(f"  tied copies: {tied_bytes / MiB:.2f} MiB of positional gradients all-reduced once "
              "per optimizer step")
    print(f"  on this machine per micro-batch: recompute {recompute * 1e3:.2f} ms, send "
          f"{send_v * 1e3:.2f} ms ({'recompute' if recompute < send_v else 'send'} cheaper by "
          f"{max(recompute, send_v) / min(recompute, send_v):.1f}x)")
end_distributed()
