"""What waits for the device in tupe_ds's optimizer step (issue 55.2), counted on the CPU:
`get_accelerator().synchronize()` calls and host reads of tensor values (tests/support/
host_reads.py), per optimizer step of EngineSteps.train, the tiny model under the DeepSpeed
engine tupe-pretrain builds (config.load, engine.build_engine), ZeRO 1 as shipped
(ds_configs/bert_large_fp16.json), 4 micro-batches, in fp32, bf16 (--bf16) and fp16 (DeepSpeed's
CPU accelerator refuses fp16 unless `is_fp16_supported` says yes, and tupe-doctor unless the
machine has a GPU: both are told so; torch's CPU kernels run the tiny model in fp16).

No micro-batch waits; the optimizer boundary reads the device once, at its overflow check and
norm (tupe_ds/train/optimizer_boundary.py). tupe_ds reads the loader's host copy of a batch on
purpose (whether it is padded, the masked tokens of each micro-batch, the labelled positions):
on a CPU those reads look like device reads, so the host copy is made of HostValues
(tests/support/host_reads.py), which everything computed from it inherits, and the copy
steps.to_device makes is a plain tensor, as the device's would be: a read of anything that came
from the device copy fails the test, wherever it is. The negative controls: DeepSpeed's
throughput timer (2 synchronize() calls a micro-batch from the third step on) and DeepSpeed's
own optimizer boundary (4 reads a step)."""

import gc
import json
import os

import pytest
import torch
from deepspeed.accelerator import get_accelerator

from host_reads import Counter, HostValue, host_values, waits
from one_process import deepspeed_group  # noqa: F401  (a fixture)
from runs import ROOT
from tupe_ds.data.loader import TrainBatches, Vocabulary
from tupe_ds.distributed.parallel import accelerator_device
from tupe_ds.machine import doctor
from tupe_ds.train import optimizer_boundary
from tupe_ds.train.config import load
from tupe_ds.train.datasets import datasets
from tupe_ds.train.engine import build_engine
from tupe_ds.train.objectives import OBJECTIVES
from tupe_ds.train import steps as steps_module
from tupe_ds.train.steps import release

BOUNDARY_READ = ("item", "tupe_ds/train/optimizer_boundary.py:scaled_norm")
STEPS, MICRO_BATCHES = 3, 4  # DeepSpeed's throughput timer synchronises from step 3 on
GPU = doctor.Machine(accelerator="cuda", gpus=1, capabilities=((9, 0),))  # for fp16 (see above)
CPU = doctor.Machine(accelerator="cpu", gpus=0)


def shipped_config(tmp_path, precision: str, **settings) -> str:
    with open(os.path.join(ROOT, "ds_configs", "bert_large_fp16.json")) as f:
        config = json.load(f)
    config["fp16"]["enabled"] = precision == "fp16"
    config.update(settings)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def counted_steps(data, tmp_path, monkeypatch, precision: str, *flags, **settings) -> list:
    """Per optimizer step, the reads and synchronisations of EngineSteps.train, each labelled
    with where it happened: "boundary" (engine.step at the accumulation boundary) or
    "micro-batch" (everything else)."""
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = shipped_config(tmp_path, precision, **settings)
    run = load(["--data", data, "--model", "tiny", "--ds-config", config, "--out",
                str(tmp_path / "out"), "--steps", str(STEPS), "--seq-len", "32",
                "--micro-batch", "2", "--global-batch", str(2 * MICRO_BATCHES), "--prefetch", "0",
                *(("--bf16",) if precision == "bf16" else ()), *flags],
               world_size=1, machine=GPU if precision == "fp16" else CPU)
    objective = OBJECTIVES[run.objective]
    _, engine, steps = build_engine(run, objective, accelerator_device())
    batches = TrainBatches(datasets(run, Vocabulary.from_data_dir(run.data), objective)["train"],
                           2, MICRO_BATCHES, 0, 1)
    # an engine an earlier test in this process left to the collector synchronises in its
    # destroy(): collected now, and no collection while the steps are counted
    gc.collect()
    gc.disable()
    counter = Counter().install(monkeypatch)
    host_values(monkeypatch)
    monkeypatch.setattr(steps_module, "to_device",
                        lambda tensor, device: tensor.as_subclass(torch.Tensor))
    phase_steps(engine, counter)
    found = []
    try:
        for _ in range(STEPS):
            micro_batches = [{name: value.as_subclass(HostValue) for name, value in batch.items()}
                             for batch in batches.next_step()]  # made on the host, before
            counter.take()
            steps.train(micro_batches, {})
            found.append(counter.take())
    finally:
        monkeypatch.undo()  # the counting off before the engine goes
        gc.enable()
        release(engine)
    return found


def phase_steps(engine, counter: Counter) -> None:
    step = engine.step

    def labelled_step(*args, **kwargs):
        counter.phase = "boundary" if engine.is_gradient_accumulation_boundary() else "micro-batch"
        try:
            return step(*args, **kwargs)
        finally:
            counter.phase = "micro-batch"
    engine.step = labelled_step
    counter.phase = "micro-batch"


def problems(found: list, boundary_waits: int = optimizer_boundary.FOREACH_WAITS) -> list:
    """What waits where it should not: anything in a micro-batch; at the boundary a
    synchronize() or more reads than `boundary_waits`."""
    said = []
    for number, reads in enumerate(found, 1):
        micro = waits([r for r in reads if r.phase == "micro-batch"])
        boundary = waits([r for r in reads if r.phase == "boundary"])
        said += [f"step {number}, micro-batch: {read.what} at {read.where}" for read in micro]
        if len(boundary) > boundary_waits or any(r.what == "synchronize" for r in boundary):
            said.append(f"step {number}, boundary: " + ", ".join(f"{r.what} at {r.where}"
                                                                  for r in boundary))
    return said


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_only_the_boundary_waits_for_the_device_once_a_step(precision, data, tmp_path,
                                                           monkeypatch, deepspeed_group):
    found = counted_steps(data, tmp_path, monkeypatch, precision)
    assert problems(found) == []
    for reads in found:
        boundary = waits([r for r in reads if r.phase == "boundary"])
        assert [(r.what, r.where) for r in boundary] == [BOUNDARY_READ]
        host_copy = {r.where for r in reads if r.phase == "micro-batch" and r.host_value}
        assert "tupe_ds/train/steps.py:_forward" in host_copy  # the host copy is read, as said
        # bf16 and fp16 pay the same at the boundary (tupe-pretrain's bf16 line says so)
        assert len(boundary) == optimizer_boundary.FOREACH_WAITS


def test_the_count_sees_the_throughput_timer(data, tmp_path, monkeypatch, deepspeed_group):
    """The negative control: DeepSpeed's throughput timer (on by default, off in the shipped
    configs) synchronises in the forward and in engine.step of every micro-batch once 2 steps
    are done."""
    found = counted_steps(data, tmp_path, monkeypatch, "fp32",
                          timers={"throughput": {"enabled": True}})
    said = problems(found)
    assert said and all(line.startswith("step 3") for line in said), said
    assert any("synchronize at deepspeed/utils/timer.py" in line for line in said), said


def test_the_count_sees_deepspeed_s_own_boundary(data, tmp_path, monkeypatch, deepspeed_group):
    """The negative control: DeepSpeed's own check and norm read the device 4 times a step."""
    found = counted_steps(data, tmp_path, monkeypatch, "bf16", "--optimizer-boundary",
                          "deepspeed")
    assert len(problems(found)) == STEPS
    assert problems(found, boundary_waits=optimizer_boundary.DEEPSPEED_WAITS) == []


def test_the_stop_check_is_a_host_collective(deepspeed_group):
    """Every step the loop asks whether some rank received SIGTERM or SIGUSR1 (a flag in host
    memory through a gloo group: the world's here, one of its own beside NCCL). The handler left
    installed holds no process group."""
    import signal

    from tupe_ds.train.stop_signal import StopSignal

    before, before_int = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGINT)
    try:
        stop = StopSignal()
        assert stop.any_rank() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.any_rank() == "SIGUSR1"
        handler = signal.getsignal(signal.SIGUSR1)
        assert not any(cell.cell_contents is stop for cell in handler.__closure__ or ())
    finally:
        signal.signal(signal.SIGUSR1, before)
        signal.signal(signal.SIGINT, before_int)


@pytest.mark.parametrize("timers, enabled", [({}, False), ({"throughput": {}}, False),
                                             ({"throughput": {"synchronized": False}}, False),
                                             ({"throughput": {"enabled": True}}, True)])
def test_the_throughput_timer_is_off_unless_a_config_turns_it_on(data, tmp_path, timers,
                                                                  enabled):
    config = shipped_config(tmp_path, "fp32", timers=timers)
    run = load(["--data", data, "--model", "tiny", "--ds-config", config, "--out",
                str(tmp_path / "out"), "--steps", "1", "--micro-batch", "2"], world_size=1,
               machine=CPU)
    assert run.ds_config["timers"]["throughput"]["enabled"] is enabled
