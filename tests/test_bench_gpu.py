"""bench/gpu/suite.py's tiny CPU plan, one timed step per row: every part of its JSON and markdown,
the verdicts that are deterministic there (operator counts at BERT-Large's depth), the rows file
written row by row while the run goes on, the report of a cut run's rows, the time budget's
skips; and that the GPU benchmarks do nothing at import."""

import json
import math
import os
import subprocess
import sys
import time
import types

import pytest
import torch.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENCODINGS = ["bert-a", "tupe-a", "tupe-r", "bert-r"]
PADDINGS = {"real": "real padding", "none": "no padding"}
KEY_PADDINGS = ["auto", "mask", "column", "unpadded"]
TABLE_ROWS = 10  # 5 models x 2 paddings at seq 32
LAYERS = 12  # half the plan's 24 (BERT-Large's depth): deep enough for fewer ops than HF's


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


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory) -> types.SimpleNamespace:
    """One run of the CPU plan: its report, markdown and rows, and its rows file as it was when
    it held two rows of the step-time table (what a kill at that moment leaves: every line is
    flushed to the file when written)."""
    folder = tmp_path_factory.mktemp("suite")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  os.path.join(ROOT, "build", "torch_extensions"))}
    for name in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # a 1-process group of its own
        env.pop(name, None)
    paths = folder / "all.json", folder / "all.md", folder / "all.rows.jsonl"
    with open(folder / "output.txt", "w+") as output:
        process = subprocess.Popen([sys.executable, "-m", "bench.gpu.suite",
                                    "--json", str(paths[0]), "--layers", str(LAYERS)],
                                   cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
        try:
            cut = rows_while_running(process, paths[2], lambda lines: len(table_rows(lines)) >= 2)
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
    rows = {(r["model"], r["seq"], r["padding"]): r for r in gpu["rows"]}
    assert set(rows) == {(model, seq, padding) for model in ["hf-bert", *ENCODINGS]
                         for seq in seqs for padding in PADDINGS}
    assert [r["padding"] for r in gpu["rows"]][:5] == ["real"] * 5  # padded rows first
    for (model, _, padding), row in rows.items():
        assert row["name"] == f"{model}, {PADDINGS[padding]}"
        for key in ("samples_per_s", "tflops", "mfu", "ms_per_step"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["name"], key, row[key])
        assert row["accumulation"] * row["micro_batch"] == 8 and row["ops"] > 0


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
                assert (f"{encoding} / hf-bert samples/s", seq, padding) in verdicts
            for encoding, target in (("tupe-a", 1.05), ("tupe-r", 1.15)):
                assert verdicts[(f"{encoding} / bert-a step time", seq, padding)]["target"] \
                    == target
            # Deterministic: from 12 layers on (BERT-Large: 24) our step runs fewer leaf operators
            # than HF's (at 4, tupe-r's positional work once per step weighs more: 1.03x)
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
    from bench import attention  # noqa: F401
    from bench.gpu import step_time, suite  # noqa: F401
    assert torch.distributed.is_initialized() == initialized


def test_bench_gpu_all_on_cpu(suite_run):
    # 18 rows of step_time.py at LAYERS layers, 33 attention candidates,
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
                 "bert-a fast pad=unpadded", "Estimated (guessed timings, not measured)",
                 "BERT-Large measured (bench/results/h100-a01eb4b.md, 2026-11-23), base sizes "
                 "estimated"):
        assert text in markdown, text


def test_rows_are_written_as_measured_and_a_cut_run_is_reported(suite_run, suite, tmp_path):
    # While the run went on, the rows file held some of the step-time table: the rows that were
    # finished, each one whole JSON line, the same as the run's final rows.
    lines = complete_lines(suite_run.cut)
    cut_rows = table_rows(lines)
    assert 2 <= len(cut_rows) < TABLE_ROWS
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
    assert any(v["name"] == "bert-a / hf-bert samples/s" for v in report["verdicts"])


def test_budget_skips_the_builds_that_do_not_fit(suite_run, suite, tmp_path, capsys):
    # A clock of our own: each build takes 5 s, the guess is 2 s, the budget 8 s. The first build
    # fits its guess; then 3 s are left for the second, whose estimate is now the measured 5 s.
    now, built = [0.0], []

    def build(row):
        def measure(settings):
            now[0] += 5
            return row
        built.append(row["name"])
        return types.SimpleNamespace(model=row["model"], seq=row["seq"],
                                     padding=row["padding"], measure=measure)

    paths = suite.parse_args(["--json", str(tmp_path / "all.json")])
    with open(paths.rows, "w") as earlier:  # an earlier run's rows: moved aside, not replaced
        earlier.write('{"finished": 1}\n')
    budget = suite.Budget(8, lambda *kind: 2, clock=lambda: now[0], started=0)
    first = suite_run.lines
    run = suite.Run(paths, budget, None, first[0]["run"])
    run.rows.write(**next(line for line in first if "head" in line and line["part"] == "gpu"))
    run.measure_rows("table", (build(row) for row in suite_run.report["gpu"]["rows"]))
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


def test_report_of_unprofiled_rows_on_cuda(suite_run, suite):
    # The CUDA plan profiles the real-padding rows only (--profiled-paddings real): the others
    # have no operator, launch or synchronisation counts, and the report says "-" for them.
    lines = []
    for line in suite_run.lines:
        if "run" in line:
            line = {"run": {**line["run"], "kind": "cuda"}}
        elif line.get("part") == "gpu" and line.get("key") in ("rows", "electra"):
            row = {**line["row"], "peak_gib": 1.0}
            if row["padding"] == "real":
                row.update(launches=row["ops"], syncs=2, sync_locations={"here.py:1": 2})
            else:
                row = {key: value for key, value in row.items()
                       if key not in ("ops", "op_names", "phases")}
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
