"""bench/gpu/suite.py's time budget: what is left of --budget-s since the process started, and
what each build is expected to take (the longest of its kind measured in this run, else
GUESSES)."""

import time

import psutil

from bench.gpu.measure import BUILDS
from bench.gpu.runners import model_config

# Seconds, for the estimates: guesses, not measurements. CUDA: step times from
# bench/results/h100-a01eb4b.md (one H100, 2026-11-23, commit a01eb4b), BERT-Large at global batch
# 256: ours 667-683 samples/s at seq 128 (0.4 s a step), HF 901; tupe-r 150 at seq 512 (1.7 s);
# ELECTRA-Base 181 (1.4 s), BERT-Base about 1100 (0.25 s); a larger micro-batch's step taken as
# long (the same global batch). Guessed, never measured: building a model and its engine
# (BERT-Large initialised on the CPU), torch.compile of our whole 24-layer block, forward and
# backward, at the first step (compile_s) and again at each new micro-batch (recompile_s: the
# block is compiled for static shapes), reading a profiled step's events (~20,000/s in Python: 37,000
# for a 24-layer tiny step took 1.7 s here; BERT-Large's 4 and 16 micro-batches at seq 128 and
# 512, kernels included), the start (imports, process group), the attention candidates, the data
# stream. CPU: rough guesses for this plan on a 2-core CPU (its models compile nothing:
# ModelConfig's choice on a CPU).
GUESSES = {
    "cuda": dict(step_s={128: 0.4, 512: 1.7}, electra_pair_step_s=1.4 + 0.25, build_s=8,
                 compile_s=60, recompile_s=60, profile_s={128: 3, 512: 10}, start_s=45,
                 attention_s=60, data_stream_s=30),
    "cpu": dict(step_s={32: 0.15}, electra_pair_step_s=0.06, build_s=1, compile_s=60,
                recompile_s=60, profile_s={32: 2}, start_s=10, attention_s=5, data_stream_s=10),
}
# Steps a profiled micro-batch runs beyond the timed ones: the operator count and the phases
# (and on CUDA the synchronisation count).
PROFILED_STEPS = {"cuda": 3, "cpu": 2}


def build_kind(part: str, build) -> tuple:
    """What a build's time is estimated by: its part, seq, padding, family (HF's model or ours:
    ours compiles) and number of micro-batches."""
    return part, build.seq, build.padding, build.family, len(build.micros)


class Guesses:
    """GUESSES for one device kind, with the compile times this run measured in their place
    once it has: a compiled build's first warm-up step less a timed step (at its first
    micro-batch the compile, at a later one the recompile), the longest so far."""

    def __init__(self, settings, kind: str):
        self.settings, self.kind, self.measured = settings, kind, {}

    def learn(self, rows: list) -> None:
        compiled = [r for r in rows if r.get("fits", True) and r.get("compile") not in
                    (None, "none")]
        for i, row in enumerate(compiled):
            key = "compile_s" if i == 0 else "recompile_s"
            seconds = row["warmup_s"][0] - row["ms_per_step"] / 1e3
            self.measured[key] = max(self.measured.get(key, 0.0), seconds)

    def seconds(self, part: str, seq: int = None, padding: str = None, family: str = None,
                micros: int = 1) -> float:
        """Seconds for one build of `part` (step_time.py's: the model, then at each of its
        micro-batches the warm-up and timed steps, for ours the compiles, for the first
        micro-batch of a profiled padding the profiled steps and reading their events), or
        for the whole of attention or data_stream."""
        guess, settings = {**GUESSES[self.kind], **self.measured}, self.settings
        if part in ("attention", "data_stream"):
            return guess[f"{part}_s"]
        step_s = guess["electra_pair_step_s"] / 2 if part == "electra" else guess["step_s"][seq]
        compiles = family == "ours" and model_config(
            settings, seq, "bert-a", settings.attention[0], settings.compile
        ).compile_mode != "none"
        profiled = part != "sweep" and padding in settings.profiled_paddings
        graphs = 2 if part == "electra" else 1  # ELECTRA's generator and discriminator
        return (guess["build_s"] + micros * (settings.warmup + settings.steps) * step_s
                + compiles * graphs * (guess["compile_s"] + (micros - 1) * guess["recompile_s"])
                + profiled * (PROFILED_STEPS[self.kind] * step_s + guess["profile_s"][seq]))


def estimate_s(settings, kind: str, parts) -> dict:
    """The start's and each of `parts`' seconds by GUESSES."""
    guesses = Guesses(settings, kind)
    estimate = {"start": GUESSES[kind]["start_s"]}
    for part in parts:
        if part in BUILDS:
            estimate[part] = sum(guesses.seconds(*build_kind(part, build))
                                 for build in BUILDS[part](settings))
        else:
            estimate[part] = guesses.seconds(part)
    return estimate


class Budget:
    """What is left of --budget-s since the process started, and what each kind of build
    (build_kind) is expected to take: the longest measured in this run, else guesses.seconds
    (a Guesses, which learns from each build's rows)."""

    def __init__(self, seconds: float, guesses, clock=time.time, started: float = None):
        self.seconds, self.guesses, self.clock = seconds, guesses, clock
        self.started = psutil.Process().create_time() if started is None else started
        self.measured = {}

    def left_s(self) -> float:
        return self.seconds - (self.clock() - self.started)

    def estimate_s(self, kind: tuple) -> float:
        return self.measured[kind] if kind in self.measured else self.guesses.seconds(*kind)

    def timed(self, kind: tuple, measure):
        """measure()'s result, its time kept as `kind`'s if the longest."""
        start = self.clock()
        result = measure()
        self.measured[kind] = max(self.measured.get(kind, 0), self.clock() - start)
        return result
