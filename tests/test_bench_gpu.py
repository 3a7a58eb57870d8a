"""bench/gpu.py at its tiny CPU default, one timed step per row: every row, ratio and count."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENCODINGS = ["bert-a", "tupe-a", "tupe-r", "bert-r"]


def test_bench_gpu_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  os.path.join(ROOT, "build", "torch_extensions"))}
    for name in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a 1-process group of its own
        env.pop(name, None)
    # About 40 s: two sequence lengths, five models each, tiny.
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--steps", "1",
                             "--warmup", "1", "--json", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    report = json.loads(out.read_text())
    seqs = report["args"]["seqs"]
    assert seqs == [32, 64]
    rows = {(r["model"], r["seq"]): r for r in report["rows"]}
    assert set(rows) == {(model, seq) for model in ["hf-bert", *ENCODINGS] for seq in seqs}
    for row in rows.values():
        for key in ("samples_per_s", "tflops", "mfu", "ms_per_step"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["model"], key, row[key])
        assert row["accumulation"] * row["micro_batch"] == 8
    for model in ("hf-bert", "bert-a", "tupe-r"):
        for seq in seqs:
            assert rows[(model, seq)]["ops"] > 0
    assert not os.path.exists(str(out) + ".tmp")

    names = {(r["name"], r["seq"]) for r in report["ratios"]}
    for seq in seqs:
        for encoding in ENCODINGS:
            assert (f"{encoding} / hf-bert samples/s", seq) in names
        assert ("tupe-a / bert-a step time", seq) in names
        assert ("tupe-r / bert-a step time", seq) in names
        assert ("tupe-r / hf-bert ops per step", seq) in names
    stdout = result.stdout
    for line in ("bert-a / hf-bert samples/s", "tupe-r / bert-a step time",
                 "tupe-r / hf-bert ops per step", "needs CUDA"):
        assert line in stdout, line
    assert "target >= 1.10: " in stdout and "target <= 1.15: " in stdout

    electra = {r["model"]: r for r in report["electra"]}
    assert set(electra) == {"electra-tiny", "bert-tiny"}
    for row in electra.values():
        assert row["seq"] == 32 and row["ms_per_step"] > 0 and row["ops"] > 0
    phases = electra["electra-tiny"]["phases"]
    assert {"electra/generator", "electra/sample", "electra/discriminator", "step/forward",
            "step/backward", "step/optimizer", "step/metrics"} <= set(phases)
    assert phases["electra/generator"]["calls"] == 2  # 2 micro-batches
    assert "electra-tiny / bert-tiny step time" in stdout
