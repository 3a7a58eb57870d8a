"""bench/gpu/step_time.py's batches and the three steps it times, each as a runner with step(),
use_batches() (another micro-batch on the same model), module() and close(): Hugging Face's BERT
with torch AMP, our model under deepspeed.initialize, and tupe_ds.pretrain's own step
(EngineSteps) for the ELECTRA-vs-BERT rows. The first two also step in phases (forward(batch),
backward(loss, last): bench/gpu/phases.py)."""

import json
import os
from typing import Optional

import deepspeed
import numpy as np
import torch
from transformers import BertConfig
from transformers import BertForMaskedLM as HFBertForMaskedLM

from bench.gpu.phases import run_step
from bench.real_lengths import padding_mask, real_lengths
from tupe_ds.data.masking import generator_draws
from tupe_ds.distributed.parallel import MegatronMPU
from tupe_ds.model import ModelConfig, build_model
from tupe_ds.model.config import DTYPES
from tupe_ds.model.layers import labelled_positions
from tupe_ds.train import optimizer_boundary
from tupe_ds.train.monitor import flops_per_step
from tupe_ds.train.normalization import PER_TOKEN, LossNormalization
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train.optim import parameter_groups
from tupe_ds.train.steps import EngineSteps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# --padding values: how the samples of a batch are padded, and the words a row's name gets.
PADDINGS = {"real": "real padding", "none": "no padding"}


def model_config(settings, seq: int, encoding: str, attention: str,
                 compile_mode: Optional[str] = None) -> ModelConfig:
    """Our model at the run's size; `compile_mode` None: the device's choice
    (ModelConfig.compile)."""
    return ModelConfig(num_layers=settings.layers, hidden_size=settings.hidden,
                       num_attention_heads=settings.heads, ffn_hidden_size=settings.ffn,
                       vocab_size=settings.vocab, seq_length=seq,
                       max_position_embeddings=max(512, max(settings.seqs)),
                       pos_encoding=encoding, attention=attention, dtype=settings.dtype,
                       compile=compile_mode)


def make_batches(settings, seq: int, micro: int, count: int, padding: str) -> list:
    """`count` micro-batches (ids, attention mask, labels, labelled positions) of random tokens,
    ~15% of the real ones labelled. padding "real": each sample's length drawn from what the
    training loader gives (bench/real_lengths.py), padding after it; "none": full length. As
    tupe_ds.pretrain does: the mask is None for a batch without padding (for both models), and
    the positions of the labelled tokens are taken on the host (labelled_positions)."""
    g = torch.Generator().manual_seed(settings.seed * 1000 + seq)
    batches = []
    for _ in range(count):
        ids = torch.randint(10, settings.vocab, (micro, seq), generator=g)
        labelled = torch.rand(micro, seq, generator=g) < 0.15
        mask = None
        if padding == "real":
            real = padding_mask(real_lengths(seq, micro, g), seq)
            ids, labelled = ids * real, labelled & real.bool()
            mask = None if real.all() else real.to(settings.device)
        labels = ids.masked_fill(~labelled, -100)
        positions = labelled_positions(labels)
        batches.append(tuple(t.to(settings.device) if t is not None else None
                             for t in (ids, mask, labels, positions)))
    return batches


def read_config(path: str) -> dict:
    with open(path if os.path.isabs(path) else os.path.join(ROOT, path)) as f:
        return json.load(f)


def config_micro_batch(path: str):
    """The micro-batch a shipped config asks for: a number, or "auto" (tupe-pretrain's probe
    picks the largest that fits; the bench sweeps its own micro-batches instead)."""
    return read_config(path)["train_micro_batch_size_per_gpu"]


def ds_config(settings, micro: int, zero_stage=None, path: Optional[str] = None) -> dict:
    """The config at `path` (default --ds-config) with the run's global batch, precision and
    micro-batch."""
    config = read_config(path or settings.ds_config)
    config["train_batch_size"] = settings.global_batch
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = settings.global_batch // micro
    config["steps_per_print"] = 10**9
    config.setdefault("fp16", {})["enabled"] = settings.dtype == "fp16"
    config.setdefault("bf16", {})["enabled"] = settings.dtype == "bf16"
    if zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = zero_stage
    return config


def fused_adamw_supported(device: torch.device) -> bool:
    try:
        weight = torch.zeros(2, device=device, requires_grad=True)
        weight.grad = torch.ones_like(weight)
        torch.optim.AdamW([weight], fused=True).step()
        return True
    except (RuntimeError, ValueError):
        return False


def deepspeed_engine(model: torch.nn.Module, config: dict):
    """The engine tupe_ds.pretrain builds: its parameter groups, megatron-core's groups, and its
    optimizer boundary (optimizer_boundary.DEFAULT)."""
    weight_decay = config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=parameter_groups(model, weight_decay), config=config,
        mpu=MegatronMPU())
    optimizer_boundary.install(engine.optimizer, optimizer_boundary.DEFAULT)
    return engine


def use_micro_batch(engine, micro: int) -> None:
    """The engine's micro-batch changed, its global batch kept (fewer or more accumulation
    steps). Only at a step's boundary into a count of accumulation steps that divides the old
    one (a larger micro-batch by a whole factor): DeepSpeed finds the boundary by counting
    micro-steps modulo the accumulation steps."""
    global_batch = engine.train_batch_size()
    engine.set_train_micro_batch_size(micro)
    engine.set_train_batch_size(global_batch)
    if engine.micro_steps % engine.gradient_accumulation_steps():
        raise ValueError(f"micro-batch {micro}: {engine.micro_steps} micro-steps so far are no "
                         f"whole number of {engine.gradient_accumulation_steps()}-micro-batch "
                         "steps; sweep micro-batches upwards by whole factors")


class MicroBatchRunner:
    """A step over `batches` made of forward(batch) and backward(loss, last) per micro-batch."""

    def step(self) -> None:
        run_step(self)


class HFRunner(MicroBatchRunner):
    """BertForMaskedLM, torch AMP, clipping, torch AdamW: the step a Hugging Face user writes."""

    def __init__(self, settings, seq: int, batches: list, ds_config: dict):
        torch.manual_seed(settings.seed)
        config = BertConfig(vocab_size=settings.vocab, hidden_size=settings.hidden,
                            num_hidden_layers=settings.layers,
                            num_attention_heads=settings.heads,
                            intermediate_size=settings.ffn, hidden_act="gelu",
                            max_position_embeddings=max(512, max(settings.seqs)),
                            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                            attn_implementation="sdpa")
        device = settings.device
        self.model = HFBertForMaskedLM(config).to(device)  # fp32 weights, built from config
        self.model.train()
        hyper = ds_config["optimizer"]["params"]  # the same lr, betas, eps and weight decay
        self.optimizer = torch.optim.AdamW(
            parameter_groups(self.model, hyper.get("weight_decay", 0.01)),
            lr=hyper.get("lr", 1e-4), betas=tuple(hyper.get("betas", (0.9, 0.999))),
            eps=hyper.get("eps", 1e-8), fused=settings.fused_adamw or None)
        self.device_type = device.type
        self.autocast = DTYPES[settings.dtype] if settings.dtype != "fp32" else None
        self.scaler = torch.amp.GradScaler(device.type, enabled=settings.dtype == "fp16")
        self.batches, self.clipping = batches, ds_config.get("gradient_clipping", 1.0)
        self.flops = flops_per_step(model_config(settings, seq, "bert-a", "fast"),
                                    settings.global_batch, seq)

    def forward(self, batch):
        ids, mask, labels, _ = batch
        with torch.autocast(self.device_type, dtype=self.autocast,
                            enabled=self.autocast is not None):
            return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

    def backward(self, loss, last: bool) -> None:
        self.scaler.scale(loss / len(self.batches)).backward()
        if not last:
            return
        if self.clipping > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clipping)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def use_batches(self, batches: list) -> None:
        self.batches = batches

    def module(self) -> torch.nn.Module:
        return self.model

    def close(self) -> None:
        vars(self).clear()


class EngineRunner:
    """A runner over a DeepSpeed engine."""

    def module(self) -> torch.nn.Module:
        return self.engine.module

    def close(self) -> None:
        self.engine.destroy()
        vars(self).clear()


class OursRunner(EngineRunner, MicroBatchRunner):
    """tupe_ds.build_model under deepspeed.initialize: the step tupe_ds.pretrain runs, less the
    accuracy metric it adds (an argmax over the logits), so both sides compute the loss only."""

    def __init__(self, settings, seq: int, batches: list, encoding: str, attention: str,
                 config: dict, compile_mode: Optional[str] = None):
        torch.manual_seed(settings.seed)
        model = build_model(model_config(settings, seq, encoding, attention, compile_mode))
        self.engine = deepspeed_engine(model, config)
        self.batches = batches
        self.flops = flops_per_step(model.model_config, settings.global_batch, seq)
        self.compile = model.model_config.compile_mode

    def forward(self, batch):
        return self.engine(*batch)[0]

    def backward(self, loss, last: bool) -> None:
        self.engine.backward(loss)
        self.engine.step()  # at the boundary the optimizer's; else it counts the micro-batch

    def use_batches(self, batches: list) -> None:
        use_micro_batch(self.engine, len(batches[0][0]))
        self.batches = batches


class TrainingStepRunner(EngineRunner):
    """tupe_ds.pretrain's own step (EngineSteps: host copies of the batches, labelled positions
    and the no-padding check taken there, the objective's metrics added per micro-batch) on the
    presets of `objective` with a shipped config: the ELECTRA-vs-BERT rows."""

    def __init__(self, settings, objective: str, presets: tuple, seq: int, batches: list,
                 config: dict):
        torch.manual_seed(settings.seed)
        models = [ModelConfig.from_preset(
            preset, pos_encoding=settings.electra_encoding, vocab_size=settings.vocab,
            seq_length=seq, max_position_embeddings=max(512, seq), dtype=settings.dtype)
            for preset in presets]
        self.objective, self.seed = OBJECTIVES[objective], settings.seed
        self.engine = deepspeed_engine(self.objective.build(models), config)
        normalization = LossNormalization(PER_TOKEN, self.objective, settings.device)
        self.steps = EngineSteps(self.engine, self.objective, normalization, settings.device)
        self.batches = self.loader_batches(batches)
        self.flops = sum(flops_per_step(m, settings.global_batch, seq) for m in models)
        self.compile = models[0].compile_mode

    def loader_batches(self, batches: list) -> list:
        """The batches as the training loader gives them: on the host, a mask for every batch,
        ELECTRA's generator draws (as the data stream draws them, sample i of batch b)."""
        out = [{"input_ids": ids.cpu(), "labels": labels.cpu(), "attention_mask":
                torch.ones_like(ids.cpu()) if mask is None else mask.cpu()}
               for ids, mask, labels, _ in batches]
        if self.objective.generator_draws:
            for b, batch in enumerate(out):
                rows = len(batch["labels"])
                batch["generator_draws"] = torch.from_numpy(generator_draws(
                    self.seed, np.zeros(rows, dtype=np.int64), b * rows + np.arange(rows),
                    batch["labels"].numpy()))
        return out

    def step(self) -> None:
        self.steps.train(self.batches, {})

    def use_batches(self, batches: list) -> None:
        use_micro_batch(self.engine, len(batches[0][0]))
        self.batches = self.loader_batches(batches)
