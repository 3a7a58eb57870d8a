"""bench/gpu/suite.py's time budget: what is left of --budget-s since the process started, and
what each row is expected to take (the longest of its kind measured in this run, else GUESSES)."""

import time

import psutil

# Seconds, for the estimates: guesses, not measurements. CUDA: step times from
# bench/results/h100-a01eb4b.md (one H100, 2026-11-23, commit a01eb4b), BERT-Large at global batch
# 256: ours 667-683 samples/s at seq 128 (0.4 s a step), HF 901; tupe-r 150 at seq 512 (1.7 s);
# ELECTRA-Base 181 (1.4 s), BERT-Base about 1100 (0.25 s). Guessed, never measured: building a model
# and its engine (BERT-Large initialised on the CPU), reading a profiled step's events (~20,000/s in
# Python: 37,000 for a 24-layer tiny step took 1.7 s here; BERT-Large's 4 and 16 micro-batches at
# seq 128 and 512, kernels included), the start (imports, process group, the first torch.compile),
# the attention candidates, the data stream. CPU: rough guesses for this plan on a 2-core CPU.
GUESSES = {
    "cuda": dict(step_s={128: 0.4, 512: 1.7}, electra_pair_step_s=1.4 + 0.25, build_s=8,
                 profile_s={128: 3, 512: 10}, start_s=45, attention_s=60, data_stream_s=30),
    "cpu": dict(step_s={32: 0.15}, electra_pair_step_s=0.06, build_s=1, profile_s={32: 2},
                start_s=10, attention_s=5, data_stream_s=10),
}

def guess_s(settings, kind: str, part: str, seq: int = None, padding: str = None) -> float:
    """GUESSES' seconds for one row of `part` (step_time.py's: its build, warm-up, timed steps and, for
    a profiled padding, the profiled steps and reading their events), or for the whole of
    attention or data_stream."""
    guess = GUESSES[kind]
    if part in ("attention", "data_stream"):
        return guess[f"{part}_s"]
    step_s = guess["electra_pair_step_s"] / 2 if part == "electra" else guess["step_s"][seq]
    profiled_steps = 2 if kind == "cuda" else 1  # the operator count (and the syncs on CUDA)
    profiled = part != "sweep" and padding in settings.profiled_paddings
    return (guess["build_s"] + (settings.warmup + settings.steps) * step_s
            + profiled * (profiled_steps * step_s + guess["profile_s"][seq]))


def estimate_s(settings, kind: str, parts) -> dict:
    """The start's and each of `parts`' seconds by GUESSES."""
    models = 1 + len(settings.encodings) * len(settings.attention)
    seq, pairs = min(settings.seqs), 2 * bool(settings.electra_encoding)
    sweep_rows = len(settings.sweep_zero_stages) * len(settings.sweep_micro_batches)
    estimate = {
        "start": GUESSES[kind]["start_s"],
        "table": sum(models * guess_s(settings, kind, "table", length, padding)
                     for length in settings.seqs for padding in settings.padding),
        "electra": sum(pairs * guess_s(settings, kind, "electra", seq, padding)
                       for padding in settings.padding),
        "attention": guess_s(settings, kind, "attention"),
        "data_stream": guess_s(settings, kind, "data_stream"),
        "sweep": sweep_rows * guess_s(settings, kind, "sweep", seq, settings.padding[0])}
    return {part: s for part, s in estimate.items() if part == "start" or part in parts}


class Budget:
    """What is left of --budget-s since the process started, and what each kind of row (part,
    seq, padding) is expected to take: the longest measured in this run, else the guess."""

    def __init__(self, seconds: float, guess, clock=time.time, started: float = None):
        self.seconds, self.guess, self.clock = seconds, guess, clock
        self.started = psutil.Process().create_time() if started is None else started
        self.measured = {}

    def left_s(self) -> float:
        return self.seconds - (self.clock() - self.started)

    def estimate_s(self, kind: tuple) -> float:
        return self.measured[kind] if kind in self.measured else self.guess(*kind)

    def timed(self, kind: tuple, measure):
        """measure()'s result, its time kept as `kind`'s if the longest."""
        start = self.clock()
        result = measure()
        self.measured[kind] = max(self.measured.get(kind, 0), self.clock() - start)
        return result
