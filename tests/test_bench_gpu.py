"""bench/gpu/suite.py's tiny CPU plan, one timed step per row: every part of its JSON and markdown,
the verdicts that are deterministic there (operator counts at BERT-Large's depth), the rows file
written row by row while the run goes on, the report of a cut run's rows, the time budget's
skips; that the GPU benchmarks do nothing at import; and their counting rules on synthetic
events and a tiny real profile (an operator whose aten children only allocate is a leaf, the
device's busy time is the union of its kernel intervals), a step's phases and their Python
calls, a micro-batch sweep that runs out of memory, the headline of each model at its best, the
budget's compile times learnt from the rows."""

import argparse
import json
import math
import os
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed
from torch.autograd import DeviceType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENCODINGS = ["bert-a", "tupe-a", "tupe-r", "bert-r"]
PADDINGS = {"real": "real padding", "none": "no padding"}
KEY_PADDINGS = ["auto", "mask", "column", "unpadded"]
TABLE_ROWS = 14  # 5 models x 2 paddings at seq 32, HF and bert-a also at micro-batch 8
SWEPT = ("hf-bert", "bert-a")  # at micro-batches 4 and 8 (the plan's --sweep-factors 2)
LAYERS = 6  # a quarter of the plan's 24 (BERT-Large's depth): deep enough for fewer ops than HF's


def complete_lines(text: str) -> list:
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def table_rows(lines: list) -> list:
    return [line["row"] for line in lines if line.get("key") == "rows"]


def rows_while_running(process, path, enough, timeout=600) -> str:
    """The rows file's text as soon as `enough(its complete lines)`, the run still going."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before its rows were seen"
        text = path.read_text() if path.exists() else ""
        if enough(complete_lines(text)):
            return text
        time.sleep(0.05)
    raise AssertionError(f"no such rows in {path} after {timeout} s")


def bench_environment() -> dict:
    """A benchmark's environment on the CPU: one thread, a 1-process group of its own."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  os.path.join(ROOT, "build", "torch_extensions"))}
    for name in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory) -> types.SimpleNamespace:
    """One run of the CPU plan: its report, markdown and rows, and its rows file as it was when
    it held HF's and bert-a's first rows of the step-time table (what a kill at that moment
    leaves: every line is flushed to the file when written)."""
    folder, env = tmp_path_factory.mktemp("suite"), bench_environment()
    paths = folder / "all.json", folder / "all.md", folder / "all.rows.jsonl"
    with open(folder / "output.txt", "w+") as output:
        process = subprocess.Popen([sys.executable, "-m", "bench.gpu.suite",
                                    "--json", str(paths[0]), "--layers", str(LAYERS)],
                                   cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
        try:
            cut = rows_while_running(process, paths[2], lambda lines: len(table_rows(lines)) >= 4)
            returncode = process.wait(timeout=900)
        finally:
            if process.poll() is None:
                process.kill()
        output.seek(0)
        assert returncode == 0, output.read()[-8000:]
    assert not os.path.exists(str(paths[0]) + ".tmp")
    return types.SimpleNamespace(report=json.loads(paths[0].read_text()),
                                 markdown=paths[1].read_text(),
                                 lines=complete_lines(paths[2].read_text()), cut=cut)


@pytest.fixture
def suite(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench.gpu import suite
    return suite


def check_step_rows(gpu: dict) -> None:
    seqs = gpu["args"]["seqs"]
    assert gpu["args"]["layers"] == LAYERS and gpu["args"]["padding"] == ["real", "none"]
    rows = {(r["model"], r["seq"], r["padding"], r["micro_batch"]): r for r in gpu["rows"]}
    assert set(rows) == {(model, seq, padding, micro) for model in ["hf-bert", *ENCODINGS]
                         for seq in seqs for padding in PADDINGS
                         for micro in ((4, 8) if model in SWEPT else (4,))}
    # the headline's builds first (what a cut run keeps), each build's micro-batches together
    assert [(r["model"], r["padding"], r["micro_batch"]) for r in gpu["rows"]][:8] == [
        (model, padding, micro) for padding in PADDINGS for model in SWEPT for micro in (4, 8)]
    for (model, _, padding, micro), row in rows.items():
        assert row["name"] == f"{model}, {PADDINGS[padding]}" and row["fits"]
        for key in ("samples_per_s", "tflops", "mfu", "ms_per_step"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["name"], key, row[key])
        assert row["accumulation"] * micro == 8 and len(row["warmup_s"]) == 2
        assert row["compile"] == (None if model == "hf-bert" else "none")  # eager on a CPU
        if micro == 4:  # each build's first micro-batch is profiled, with its phases
            assert row["ops"] > 0 and set(row["phase_ms"]) == {"host_ms"}
            assert row["phase_ms"]["host_ms"]["boundary"] > 0
        else:
            assert "ops" not in row and "phase_ms" not in row


def check_verdicts(report: dict, seqs: list) -> None:
    verdicts = {(v["name"], v.get("seq"), v.get("padding")): v for v in report["verdicts"]}
    for v in verdicts.values():
        assert math.isfinite(v["value"]) and v["value"] > 0, v
        if v["target"] is not None:  # pass agrees with value and target
            assert v["pass"] == (v["value"] <= v["target"] if v["at_most"]
                                 else v["value"] >= v["target"]), v
    for seq in seqs:
        for padding in PADDINGS:
            for encoding in ENCODINGS:
                best = verdicts[(f"{encoding} at its best / hf-bert at its best samples/s", seq,
                                 padding)]
                assert best["target"] == 1.1 and best["detail"].startswith(" (micro-batch ")
                assert (f"{encoding} / hf-bert samples/s, micro-batch 4 both", seq,
                        padding) in verdicts
            for encoding, target in (("tupe-a", 1.05), ("tupe-r", 1.15)):
                assert verdicts[(f"{encoding} / bert-a step time", seq, padding)]["target"] \
                    == target
            # Deterministic: from 6 layers on (BERT-Large: 24) our step runs fewer leaf operators
            # than HF's, fewer for each layer (at 6: 0.74-0.77x for bert-a, 0.87-0.89x for tupe-r,
            # whose positional work once per step weighs more; at 12: 0.71-0.81x)
            for encoding in ("bert-a", "tupe-r"):
                ops = verdicts[(f"{encoding} / hf-bert ops per step", seq, padding)]
                assert ops["target"] == 1.0 and ops["pass"] is True, ops
    for padding in PADDINGS:
        electra = verdicts[("electra-tiny / bert-tiny step time", seqs[0], padding)]
        assert electra["target"] == 1.5
    for seq, target in ((128, 20_000), (512, 6_000)):
        assert verdicts[("data stream samples/s on one core", seq, None)]["target"] == target


def check_electra_and_sweep(gpu: dict) -> None:
    electra = {(r["model"], r["padding"]): r for r in gpu["electra"]}
    assert set(electra) == {(m, p) for m in ("electra-tiny", "bert-tiny") for p in PADDINGS}
    for row in electra.values():
        assert row["seq"] == 32 and row["ms_per_step"] > 0 and row["ops"] > 0
    phases = electra[("electra-tiny", "real")]["phases"]
    assert {"electra/generator", "electra/sample", "electra/discriminator", "step/forward",
            "step/backward", "step/optimizer", "step/metrics"} <= set(phases)
    assert phases["electra/generator"]["calls"] == 2  # 2 micro-batches
    sweep = {(r["zero_stage"], r["micro_batch"]) for r in gpu["sweep"]}
    assert sweep == {(stage, micro) for stage in (0, 1) for micro in (4, 8)}
    assert {r["padding"] for r in gpu["sweep"]} == {"real"}


def check_attention(attention: dict) -> None:
    rows = {(r["name"], r["padding"]): r for r in attention["rows"]}
    for encoding in ENCODINGS:
        assert (f"{encoding} dense", "real") in rows and (f"{encoding} dense", "none") in rows
        for key_padding in KEY_PADDINGS:
            assert any(r["encoding"] == encoding and r["key_padding"] == key_padding
                       and r["padding"] == "real" for r in attention["rows"]), key_padding
    assert rows[("bert-a fast pad=unpadded", "real")]["reaches_sdpa"].startswith("nested")
    assert rows[("bert-a fast pad=auto", "real")]["x_bert_a"] == 1.0
    for row in attention["rows"]:
        assert math.isfinite(row["median_ms"]) and row["median_ms"] > 0, row


def test_gpu_benchmarks_do_nothing_at_import(monkeypatch):  # first: before they are imported
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.setattr(sys, "argv", ["pytest", "--no-such-flag"])  # parsed at import: an error
    initialized = torch.distributed.is_initialized()
    from bench import attention, host_calls  # noqa: F401
    from bench.gpu import step_time, suite  # noqa: F401
    assert torch.distributed.is_initialized() == initialized


@pytest.mark.slow
def test_bench_gpu_all_on_cpu(suite_run):
    # 22 rows of step_time.py at LAYERS layers, 33 attention candidates,
    # the data stream of a tiny corpus (written once into build/bench-data-stream).
    report, markdown = suite_run.report, suite_run.markdown
    parts = ["table", "electra", "attention", "data_stream", "sweep"]
    assert list(report["elapsed_s"]) == parts and report["finished_s"] > 0
    assert list(report["estimate_s"]) == ["start", *parts]
    assert all(seconds > 0 for seconds in report["estimate_s"].values())
    assert report["skipped"] == []  # everything fits the default budget at the tiny size
    check_step_rows(report["gpu"])
    check_verdicts(report, report["gpu"]["args"]["seqs"])
    check_electra_and_sweep(report["gpu"])
    check_attention(report["attention"])
    for seq in ("128", "512"):
        assert report["data_stream"]["later"]["seq"][seq]["samples_per_s"] > 0
    for text in ("## All verdicts", "## Step time, ELECTRA, ZeRO sweep", "## Attention candidates",
                 "## Data stream", "| bert-a, real padding | 32 |", "| tupe-r, no padding | 32 |",
                 "tupe-r / hf-bert ops per step", "electra-tiny / bert-tiny step time",
                 "Host synchronisations: not counted", "ZeRO stage x micro-batch",
                 "| hf-bert, real padding | 32 | 8 x 1 |", "One step in phases",
                 "bert-a fast pad=unpadded", "Estimated (guessed timings, not measured)",
                 "BERT-Large measured (bench/results/h100-a01eb4b.md, 2026-11-23), base sizes "
                 "estimated"):
        assert text in markdown, text


def test_rows_are_written_as_measured_and_a_cut_run_is_reported(suite_run, suite, tmp_path):
    # While the run went on, the rows file held some of the step-time table: the rows that were
    # finished, each one whole JSON line, the same as the run's final rows.
    lines = complete_lines(suite_run.cut)
    cut_rows = table_rows(lines)
    assert 4 <= len(cut_rows) < TABLE_ROWS
    assert cut_rows == suite_run.report["gpu"]["rows"][:len(cut_rows)]
    assert "run" in lines[0] and not any("elapsed_s" in line for line in lines)
    # A kill leaves those lines and perhaps one cut mid-write: --report-only reports the rows
    rows = tmp_path / "cut.rows.jsonl"
    rows.write_text(suite_run.cut.rstrip("\n") + "\n" + '{"part": "gpu", "key": "rows", "ro')
    suite.main(["--report-only", "--rows", str(rows), "--json", str(tmp_path / "cut.json")])
    report = json.loads((tmp_path / "cut.json").read_text())
    markdown = (tmp_path / "cut.md").read_text()
    assert report["gpu"]["rows"] == cut_rows and "finished_s" not in report
    assert "unfinished" in markdown and "## Attention candidates" not in markdown
    for i, row in enumerate(suite_run.report["gpu"]["rows"]):
        assert (f"| {row['name']} | 32 |" in markdown) == (i < len(cut_rows)), row["name"]
    assert any(v["name"] == "bert-a at its best / hf-bert at its best samples/s"
               for v in report["verdicts"])


def test_budget_skips_the_builds_that_do_not_fit(suite_run, suite, tmp_path, capsys):
    # A clock of our own: each build takes 5 s, the guess is 2 s, the budget 8 s. The first build
    # fits its guess; then 3 s are left for the second, whose estimate is now the measured 5 s.
    now, built = [0.0], []

    def build(row):
        def measure(settings, on_row, more):
            now[0] += 5
            on_row(row)
            return [row]
        built.append(row["name"])
        return types.SimpleNamespace(model=row["model"], seq=row["seq"], padding=row["padding"],
                                     family="ours", micros=[4], measure=measure)

    paths = suite.parse_args(["--json", str(tmp_path / "all.json")])
    with open(paths.rows, "w") as earlier:  # an earlier run's rows: moved aside, not replaced
        earlier.write('{"finished": 1}\n')
    guesses = types.SimpleNamespace(seconds=lambda *kind, **extra: 2, learn=lambda rows: None)
    budget = suite.Budget(8, guesses, clock=lambda: now[0], started=0)
    first = suite_run.lines
    run = suite.Run(paths, budget, None, first[0]["run"])
    run.rows.write(**next(line for line in first if "head" in line and line["part"] == "gpu"))
    firsts = [row for row in suite_run.report["gpu"]["rows"] if row["micro_batch"] == 4]
    run.part("table", lambda: run.measure_rows("table", (build(row) for row in firsts)))
    assert built == ["hf-bert, real padding", "bert-a, real padding"]  # no later build made
    printed = capsys.readouterr().out
    assert "skipped: table rows from bert-a, real padding, seq 32 on (5 s estimated, " \
        "3 s of the 8 s budget left); to run table alone: `python3 -m bench.gpu.suite --parts " \
        "table --json build/bench-gpu-all-table.json`" in printed
    report = json.loads((tmp_path / "all.json").read_text())
    assert [row["name"] for row in report["gpu"]["rows"]] == ["hf-bert, real padding"]
    assert report["skipped"] == [printed.split("skipped: ")[1].strip()]
    assert "Skipped: table rows from bert-a" in (tmp_path / "all.md").read_text()
    aside = [name for name in os.listdir(tmp_path) if name.startswith("all.rows.2")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_text() == '{"finished": 1}\n'


def test_a_build_that_raises_is_reported_and_a_budget_spent_mid_build_keeps_its_rows(
        suite_run, suite, tmp_path, capsys):
    """On a clock of our own: a build that raises after its first row (a compile error at its
    second micro-batch) is recorded with its first lines, its row kept, and the next build
    measured; that one's larger micro-batches stop when the next one's time no longer fits
    (2 s a micro-batch, 10 s in all)."""
    now = [0.0]

    def build(name, micros, raises=False):
        def measure(settings, on_row, more):
            for micro in micros:
                if micro != micros[0] and not more():
                    break
                now[0] += 1 if raises else 4
                on_row({**row, "name": f"{name}, real padding", "model": name,
                        "micro_batch": micro})
                if raises:
                    raise RuntimeError("inductor: compile failed (injected)\nits second line")
        return types.SimpleNamespace(model=name, seq=32, padding="real", family="ours",
                                     micros=micros, measure=measure)

    def seconds(part, seq, padding, family, micros=1):
        return 2 * micros

    row = next(row for row in suite_run.report["gpu"]["rows"] if row["model"] == "bert-a")
    paths = suite.parse_args(["--json", str(tmp_path / "all.json")])
    budget = suite.Budget(10, types.SimpleNamespace(seconds=seconds, learn=lambda rows: None),
                          clock=lambda: now[0], started=0)
    run = suite.Run(paths, budget, None, suite_run.lines[0]["run"])
    run.rows.write(**next(line for line in suite_run.lines
                          if "head" in line and line["part"] == "gpu"))
    run.part("table", lambda: run.measure_rows("table", iter([
        build("tupe-a", [4, 8], raises=True), build("bert-a", [4, 8, 16])])))
    report = json.loads((tmp_path / "all.json").read_text())
    assert [(r["model"], r["micro_batch"]) for r in report["gpu"]["rows"]] == [
        ("tupe-a", 4), ("bert-a", 4), ("bert-a", 8)]
    assert report["failed"] == [{"failed": "table: tupe-a, real padding, seq 32",
                                 "error": ["RuntimeError: inductor: compile failed (injected)",
                                           "its second line"],
                                 "at": report["failed"][0]["at"]}]
    assert "test_bench_gpu.py:" in report["failed"][0]["at"]  # where it was raised
    assert report["skipped"] == ["the larger micro-batches of bert-a, real padding, seq 32 (2 s "
                                 "estimated, 1 s of the 10 s budget left); to run table alone: "
                                 "`python3 -m bench.gpu.suite --parts table --json "
                                 "build/bench-gpu-all-table.json`"]
    markdown = (tmp_path / "all.md").read_text()
    assert "**Failed: table: tupe-a, real padding, seq 32** (at `" in markdown
    assert "RuntimeError: inductor: compile failed (injected)\nits second line" in markdown
    assert run.failures == 1
    assert "failed: table: tupe-a, real padding, seq 32: RuntimeError: inductor: compile " \
        "failed (injected) (at " in capsys.readouterr().out


INJECT = """import contextlib
import json
import sys
from bench import host_calls
from bench.gpu import measure
real_ours, real_host = measure.ours_runner, host_calls.make_runner


def ours_runner(settings, seq, encoding, *rest):
    if encoding == "tupe-a":
        raise RuntimeError("inductor: compile failed (injected)")
    return real_ours(settings, seq, encoding, *rest)


def make_runner(settings, row, batches):
    if row == "bert-a/none":
        raise RuntimeError("inductor: compile failed (injected)")
    return real_host(settings, row, batches)


measure.ours_runner, host_calls.make_runner = ours_runner, make_runner
from bench.gpu import step_time, suite
step_time.CPU_SIZE["matmul_n"] = 256  # the peak for MFU, not 2048^3 (3 CPU-s): not read here
commands = json.loads(sys.argv[1])
codes = {}
for name, main in (("suite", suite.main), ("host_calls", host_calls.main)):
    with open(commands[name]["stdout"], "w") as out, contextlib.redirect_stdout(out):
        try:
            main(commands[name]["argv"])
            codes[name] = 0
        except SystemExit as exit:
            codes[name] = exit.code
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def failing_runs(tmp_path_factory) -> types.SimpleNamespace:
    """The CPU plan at 2 layers with tupe-a's build failing, then bench/host_calls.py with
    bert-a/none's failing (as compile errors would), one after the other in one process (one
    start fewer; each ends its process group): their folder, and per command its exit code and
    stdout."""
    folder = tmp_path_factory.mktemp("failing")
    commands = {
        "suite": ["--json", str(folder / "all.json"), "--layers", "2", "--parts",
                  "table,attention"],
        "host_calls": ["--rows", "hf,bert-a/none,tupe-r/none", "--layers", "2", "--warmup", "1",
                       "--steps", "1", "--json", str(folder / "host.json")]}
    commands = {name: {"argv": argv, "stdout": str(folder / f"{name}.out")}
                for name, argv in commands.items()}
    done = subprocess.run([sys.executable, "-c", INJECT, json.dumps(commands)], cwd=ROOT,
                          env=bench_environment(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    codes = json.loads(done.stdout.splitlines()[-1])
    return types.SimpleNamespace(folder=folder, **{name: types.SimpleNamespace(
        returncode=codes[name], stdout=(folder / f"{name}.out").read_text(),
        stderr=done.stderr) for name in commands})


@pytest.mark.slow
def test_a_model_that_fails_to_build_leaves_every_other_row_and_part(failing_runs):
    """The CPU plan at 2 layers with tupe-a's build failing (as a compile error would): exit 1,
    and the JSON and markdown hold every other model's rows, the failure's lines, and the part
    after it (attention, measured in the suite's process, where data_stream starts two more)."""
    done, folder = failing_runs.suite, failing_runs.folder
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((folder / "all.json").read_text())
    markdown = (folder / "all.md").read_text()
    assert {row["model"] for row in report["gpu"]["rows"]} == {"hf-bert", *ENCODINGS} - {"tupe-a"}
    assert [f["failed"] for f in report["failed"]] == [
        f"table: tupe-a, {padding}, seq 32" for padding in PADDINGS.values()]
    assert all(f["error"] == ["RuntimeError: inductor: compile failed (injected)"]
               for f in report["failed"])
    assert report["attention"]["rows"] and "attention" in report["elapsed_s"]
    assert "**Failed: table: tupe-a, real padding, seq 32**" in markdown
    assert "2 part(s) or build(s) failed: see the report" in done.stdout


@pytest.mark.slow
def test_host_calls_keeps_the_rows_of_the_others_when_one_fails(failing_runs):
    done = failing_runs.host_calls
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((failing_runs.folder / "host.json").read_text())
    assert [r["row"] for r in result["rows"]] == ["hf", "tupe-r/none"]
    assert result["failed"] == [{"row": "bert-a/none", "error": [
        "RuntimeError: inductor: compile failed (injected)"]}] and result["finished"]
    assert [r["row"] for r in result["ratios"]] == ["tupe-r/none"]
    assert "failed: RuntimeError: inductor: compile failed (injected); going on" in done.stdout
    assert "Failed: bert-a/none: RuntimeError: inductor: compile failed (injected)" in done.stdout


def test_report_of_unprofiled_rows_on_cuda(suite_run, suite):
    # The CUDA plan profiles the real-padding rows only (--profiled-paddings real): the others
    # have no operator, launch or synchronisation counts, and the report says "-" for them.
    lines = []
    for line in suite_run.lines:
        if "run" in line:
            line = {"run": {**line["run"], "kind": "cuda"}}
        elif line.get("part") == "gpu" and line.get("key") in ("rows", "electra"):
            row = {**line["row"], "peak_gib": 1.0}
            if row["padding"] == "real" and "ops" in row:
                row.update(launches=row["ops"], syncs=2, sync_locations={"here.py:1": 2},
                           device_busy_fraction=0.5)
                if "phase_ms" in row:
                    row["phase_ms"] = {**row["phase_ms"], "device_ms": row["phase_ms"]["host_ms"]}
            else:
                row = {key: value for key, value in row.items()
                       if key not in ("ops", "op_names", "phases", "phase_ms")}
            line = {**line, "row": row}
        lines.append(line)
    from bench.gpu import suite_report

    content = suite_report.content_of(lines)
    markdown = suite_report.markdown(content)
    assert "| bert-a, no padding | 32 | 4 x 2 |" in markdown
    unprofiled = next(line for line in markdown.splitlines()
                      if line.startswith("| bert-a, no padding | 32 | 4 x 2 |"))
    assert unprofiled.count("| - |") >= 1 and "| 1.0 |" in unprofiled
    ops = [v for v in content["verdicts"] if v["name"] == "bert-a / hf-bert ops per step"]
    assert [v["padding"] for v in ops] == ["real"]
    assert "| bert-a, real padding | 32 | 2 | here.py:1 x2 |" in markdown
    assert "device ms: boundary" in markdown and "| 0.50 |" in markdown


def profiler_event(name, parent=None, start=0.0, end=0.0, device=DeviceType.CPU,
                   annotation=False):
    """What leaf_aten_ops and device_busy read of a torch.profiler event."""
    return types.SimpleNamespace(name=name, cpu_parent=parent, device_type=device,
                                 is_user_annotation=annotation,
                                 time_range=types.SimpleNamespace(start=start, end=end))


@pytest.fixture
def gpu_bench(monkeypatch):
    """bench.gpu's counts, phases, measure and report (imported here, not at the file's import:
    the first test imports the benchmarks itself)."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.gpu import counts, measure, phases, report
    return types.SimpleNamespace(counts=counts, measure=measure, phases=phases, report=report)


def test_an_operator_whose_aten_children_only_allocate_is_a_leaf(gpu_bench):
    counts = gpu_bench.counts
    event = profiler_event
    step = event("bench/step")  # a profiler range: not an operator
    layer_norm = event("aten::layer_norm", step)
    native = event("aten::native_layer_norm", layer_norm)
    attention = event("aten::_scaled_dot_product_flash_attention_for_cpu", step)
    contiguous = event("aten::contiguous", step)  # copies: its clone's copy_ is the kernel
    clone = event("aten::clone", contiguous)
    copy = event("aten::copy_", clone)
    to = event("aten::to", step)  # copies nothing: no kernel
    events = [step, layer_norm, native, event("aten::empty", native), event("aten::view", native),
              attention, event("aten::empty", attention), event("aten::empty_strided", attention),
              contiguous, clone, event("aten::empty_like", clone), copy, to,
              event("aten::add", step)]
    assert counts.leaf_aten_ops(events) == {"aten::native_layer_norm": 1, "aten::copy_": 1,
                                            "aten::_scaled_dot_product_flash_attention_for_cpu": 1,
                                            "aten::add": 1}


def test_a_real_profile_counts_layer_norm_and_attention(gpu_bench):
    counts = gpu_bench.counts
    x = torch.randn(2, 4, 8, 16)
    with torch.profiler.profile() as prof:
        torch.nn.functional.layer_norm(x, (16,))
        torch.nn.functional.scaled_dot_product_attention(x, x, x)
    names = counts.leaf_aten_ops(prof.events())
    assert names["aten::native_layer_norm"] == 1 and "aten::layer_norm" not in names
    assert any("attention" in name for name in names), names


@pytest.mark.parametrize("intervals, covered", [
    ([], 0.0), ([(0, 10)], 10.0), ([(0, 10), (5, 15)], 15.0), ([(0, 10), (2, 3)], 10.0),
    ([(20, 30), (0, 10)], 20.0), ([(0, 10), (10, 12)], 12.0), ([(0, 4), (1, 2), (3, 9)], 9.0)])
def test_busy_time_is_the_union_of_intervals(gpu_bench, intervals, covered):
    assert gpu_bench.counts.union_us(intervals) == covered


def test_device_busy_fraction_over_the_step_span(gpu_bench):
    counts = gpu_bench.counts
    # two streams overlapping for 10 us, an idle gap, a kernel after the host's range ends; the
    # range as the profiler also shows it on the GPU's timeline (an annotation, no kernel)
    kernels = [profiler_event(name, start=s, end=e, device=DeviceType.CUDA)
               for name, s, e in (("gemm", 10, 40), ("copy", 30, 50), ("norm", 90, 110))]
    on_gpu = profiler_event(counts.STEP_RANGE, start=5, end=112, device=DeviceType.CUDA,
                            annotation=True)
    busy = counts.device_busy([on_gpu, profiler_event(counts.STEP_RANGE, start=0, end=100)]
                              + kernels, counts.STEP_RANGE)
    assert busy["device_busy_ms"] == 0.06  # (50 - 10) + (110 - 90) us, not the sum's 70
    assert busy["device_span_ms"] == 0.11 and busy["device_busy_fraction"] == 60 / 110


class Counting:
    """A runner whose phases make known numbers of Python calls."""

    def __init__(self, micro_batches):
        self.batches = list(range(micro_batches))

    def forward(self, batch):
        for _ in range(3):
            abs(batch)  # a C call each
        return batch

    def backward(self, loss, last):
        if last:
            sorted([2, 1])  # the optimizer's


def test_phases_and_their_python_calls(gpu_bench):
    phases = gpu_bench.phases
    runner = Counting(3)
    occurrences = []
    phases.run_step(runner, lambda phase: occurrences.append(phase))
    assert occurrences == ["forward", "backward", "forward", "backward", "forward", "boundary",
                           None]
    counted = phases.count_calls(runner)
    calls, frames = counted["calls"], counted["python_frames"]
    assert calls["forward"] >= 4  # the call, 3 abs
    assert 1 <= frames["forward"] <= calls["forward"] - 3  # abs: a builtin, not a Python frame
    assert calls["boundary"] == calls["backward"] + 1  # the same, and sorted
    assert calls["micro_batch"] == calls["forward"] + calls["backward"]
    assert calls["step"] == 3 * calls["forward"] + 2 * calls["backward"] + calls["boundary"]
    assert phases.count_calls(runner) == counted  # deterministic
    one = phases.count_calls(Counting(1))["calls"]
    assert "backward" not in one and "micro_batch" not in one
    timed = phases.time_phases(runner, 2, False, lambda: None)
    assert set(timed) == {"host_ms"}
    assert set(timed["host_ms"]) == {"forward", "backward", "boundary", "micro_batch", "step"}


class Sized:
    """A runner that runs out of memory above `fits` samples a micro-batch."""

    def __init__(self, fits, micro, batches):
        self.fits, self.flops, self.model = fits, 1e6, torch.nn.Linear(1, 1)
        self.use_batches(batches)

    def use_batches(self, batches):
        if len(batches[0][0]) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.batches = batches

    def step(self):
        pass

    def module(self):
        return self.model

    def close(self):
        vars(self).clear()


def settings(**overrides):
    return argparse.Namespace(**{
        "seed": 0, "vocab": 64, "device": torch.device("cpu"), "cuda": False, "warmup": 2,
        "steps": 1, "global_batch": 16, "peak_flops": 1e9, "profiled_paddings": [], **overrides})


def test_a_micro_batch_that_runs_out_of_memory_does_not_fit_and_ends_the_sweep(gpu_bench):
    measure = gpu_bench.measure
    build = measure.Build("hf-bert", "real", 16, [2, 4, 8, 16],
                          lambda micro, batches: Sized(4, micro, batches))
    rows = build.measure(settings())
    assert [(r["micro_batch"], r["fits"]) for r in rows] == [(2, True), (4, True), (8, False)]
    assert rows[2]["error"].startswith("CUDA out of memory")
    assert rows[1]["accumulation"] == 4 and len(rows[0]["warmup_s"]) == 2
    # out of memory at the build itself: one row, no runner to free
    first = measure.Build("hf-bert", "real", 16, [8, 16],
                          lambda micro, batches: Sized(4, micro, batches)).measure(settings())
    assert [(r["micro_batch"], r["fits"]) for r in first] == [(8, False)]


def row(model, micro, samples_per_s=None, **more):
    where = {"model": model, "seq": 128, "padding": "real", "micro_batch": micro}
    if samples_per_s is None:
        return {**where, "fits": False}
    return {**where, "fits": True, "samples_per_s": samples_per_s,
            "ms_per_step": 256e3 / samples_per_s, "mfu": 0.3, **more}


def test_the_headline_is_each_model_at_its_best(gpu_bench):
    report = gpu_bench.report
    rows = [row("hf-bert", 64, 1000, ops=100), row("hf-bert", 128, 1100), row("hf-bert", 256),
            row("bert-a", 64, 700, ops=80), row("bert-a", 128, 1300), row("bert-a", 256, 1250),
            row("tupe-r", 64, 600, ops=90)]
    verdicts = {v["name"]: v for v in report.table_verdicts(argparse.Namespace(
        seqs=[128], padding=["real"], attention=["fast"], encodings=["bert-a", "tupe-r"],
        micro_batches=[64], cuda=True), rows)}
    best = verdicts["bert-a at its best / hf-bert at its best samples/s"]
    assert best["value"] == 1300 / 1100 and best["pass"] is True
    assert best["detail"] == " (micro-batch 128 / 128)"
    assert verdicts["tupe-r at its best / hf-bert at its best samples/s"]["value"] == 600 / 1100
    like = verdicts["bert-a / hf-bert samples/s, micro-batch 64 both"]
    assert like["value"] == 0.7 and like["target"] is None
    assert verdicts["tupe-r / bert-a step time"]["value"] == pytest.approx(700 / 600)
    assert verdicts["bert-a / hf-bert ops per step"]["value"] == 0.8
    assert verdicts["bert-a at its best MFU"]["target"] == report.MFU_TARGET


def test_the_suite_budget_learns_compile_times_from_the_rows(gpu_bench):
    from bench.gpu.suite_budget import GUESSES, Guesses

    plan = settings(layers=2, hidden=64, heads=4, ffn=128, vocab=512, seqs=[128], dtype="fp16",
                    attention=["fast"], compile="block", warmup=2, steps=3,
                    profiled_paddings=["real"])
    guesses = Guesses(plan, "cuda")
    guess = GUESSES["cuda"]
    step = guess["step_s"][128]
    hf = guess["build_s"] + 2 * 5 * step + 3 * step + guess["profile_s"][128]
    assert guesses.seconds("table", 128, "real", "hf", 2) == pytest.approx(hf)
    ours = guesses.seconds("table", 128, "real", "ours", 2)
    assert ours == pytest.approx(hf + guess["compile_s"] + guess["recompile_s"])
    guesses.learn([{"fits": True, "compile": "block", "warmup_s": [20.5, 0.5], "ms_per_step": 500},
                   {"fits": True, "compile": "block", "warmup_s": [10.5, 0.5], "ms_per_step": 500},
                   {"fits": False, "compile": "block"}])
    guesses.learn([{"fits": True, "compile": None, "warmup_s": [99.0, 0.5], "ms_per_step": 500}])
    assert guesses.measured == {"compile_s": 20.0, "recompile_s": 10.0}
    assert guesses.seconds("table", 128, "real", "ours", 2) == pytest.approx(hf + 30)


def test_host_calls_report_and_rows(gpu_bench, capsys):
    from bench import host_calls

    def figures(forward, backward, boundary):
        return {"forward": forward, "backward": backward, "boundary": boundary,
                "micro_batch": forward + backward, "step": 4 * forward + 3 * backward + boundary}

    results = [{"row": row, "compile": compile_mode, "first_step_s": 1.0,
                "calls": figures(*calls), "python_frames": figures(*frames),
                "host_ms": figures(*ms)}
               for row, compile_mode, calls, frames, ms in (
                   ("hf", "-", (6400, 40, 14400), (4000, 16, 7800), (20, 18, 24)),
                   ("bert-a/block", "block", (4400, 1960, 19800), (1200, 200, 8300),
                    (24, 14, 27)),
                   ("bert-a/none", "none", (12600, 4700, 22600), (6000, 2000, 9000),
                    (24, 18, 30)))]
    ratios = {r["row"]: r for r in host_calls.ratios(results)}
    assert set(ratios) == {"bert-a/block", "bert-a/none"}
    assert ratios["bert-a/block"]["calls_micro_batch"] == 6360 / 6440
    assert ratios["bert-a/block"]["python_frames_micro_batch"] == 1400 / 4016
    settings = host_calls.parse_args(["--rows", "hf,bert-a/block,bert-a/none"])
    settings.cuda, settings.machine = False, "a CPU"
    text = host_calls.report(settings, results, list(ratios.values()))
    assert "| bert-a/block | 0.988 | " in text and "| PASS |" in text and "| FAIL |" in text
    assert "| 0.349 |" in text  # its Python frames per micro-batch
    assert "device ms" not in text  # CPU: host only
    with pytest.raises(SystemExit):
        host_calls.parse_args(["--rows", "hf,bert-a/fused"])
    assert "neither hf nor ENCODING/COMPILE[+cpp]" in capsys.readouterr().err
    assert host_calls.parse_args(["--rows", "hf,bert-a/block+cpp"]).rows == [
        "hf", "bert-a/block+cpp"]
