"""Compiled regions (ModelConfig.compile) against eager: the whole block, and the fused
elementwise kernels (torch.compile'd bias-dropout-add and bias-GELU)."""

import contextlib
import math
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch._inductor.config
from megatron.core.fusions import fused_bias_dropout
from torch._dynamo.utils import counters

from runs import ROOT, command, environment, free_port
from test_attention import inputs, loss_logits_grads
from tupe_ds.distributed import parallel
from tupe_ds.model import config
from tupe_ds.model.attention import BiasGeluMLP, GroupedRowParallelLinear
from tupe_ds.model.config import ModelConfig
from tupe_ds.tools import first_call_compile


@pytest.fixture
def compile_afresh():
    """compile_afresh(fallback_random): set inductor's `fallback_random` and start from no
    compiled graph and zeroed compile counters; drop the test's graphs after it. Dynamo does not
    guard on inductor's settings: a graph compiled under the other setting (by an earlier test)
    would be reused as it is."""
    with contextlib.ExitStack() as settings:

        def start(fallback_random: bool):
            torch._dynamo.reset()
            counters.clear()
            settings.enter_context(torch._inductor.config.patch(fallback_random=fallback_random))

        yield start
        torch._dynamo.reset()


@pytest.fixture
def one_thread():
    """One torch thread for the test, as a rank (OMP_NUM_THREADS=1) and the suite's xdist
    processes have: inductor's CPU kernels, and its cache's keys, depend on the thread count, so
    that a rank finds in the node's cache the graph compiled here (as compile_failure_worker.py's
    rank 0 does, ~30 CPU seconds where `pytest` ran with 2 threads, 2026-12-02)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_fused_elementwise_matches_eager(tiny_model, compile_afresh):
    """With dropout on, the fused model (compiled bias-dropout-add and bias-GELU) gives eager's
    loss, logits and gradients: its dropout drops the same elements and scales the kept ones by
    1/(1-p). `fallback_random` makes the compiled code draw its masks from eager's generator, in
    eager's order; attention dropout (eager SDPA in both models, no part of the fusion) stays off,
    so that a difference can only come from the fused kernels."""
    compile_afresh(fallback_random=True)
    ids, mask, labels = inputs(padded=True)
    eager = tiny_model("tupe-r", compile="none", hidden_dropout=0.1)
    fused = tiny_model("tupe-r", compile="elementwise", hidden_dropout=0.1)
    assert isinstance(fused.encoder.block.layers[0].mlp, BiasGeluMLP)
    assert fused.encoder.block.layers[0].config.bias_dropout_fusion
    assert not isinstance(eager.encoder.block.layers[0].mlp, BiasGeluMLP)
    assert eager.training and fused.training
    torch.manual_seed(1)
    expected_loss, expected_logits, expected_grads = loss_logits_grads(eager, ids, mask, labels)
    torch.manual_seed(1)
    loss, logits, grads = loss_logits_grads(fused, ids, mask, labels)
    assert counters["stats"]["unique_graphs"] >= 2  # bias-dropout-add and bias-GELU, compiled
    assert not counters["graph_break"]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_a_deferred_compile_compiles_at_the_first_call_and_traces_into_a_region(compile_afresh):
    """What megatron-core's and DeepSpeed Muon's torch.compile decorations are in a process that
    imported tupe_ds first (tupe_ds/tools/first_call_compile.py): nothing compiled when it
    decorates, one graph at the first call, the function's values; first called inside a region
    being compiled, traced into it, whole (fullgraph), without a graph of its own."""
    from deepspeed.runtime.zero.muon import original_muon
    from megatron.core import jit

    compiled_on_first_call = first_call_compile.compiled_on_first_call
    assert jit.jit_fuser is compiled_on_first_call  # conftest.py imports tupe_ds first
    muon = original_muon.zeropower_via_newtonschulz5
    assert muon.__code__.co_filename == first_call_compile.__file__
    compile_afresh(fallback_random=False)

    def scaled_gelu(x):
        return torch.nn.functional.gelu(x) * 2

    x = torch.randn(4, 8)
    deferred = compiled_on_first_call(backend="eager")(scaled_gelu)
    assert counters["stats"]["unique_graphs"] == 0
    torch.testing.assert_close(deferred(x), scaled_gelu(x))
    deferred(x)
    assert counters["stats"]["unique_graphs"] == 1
    first_in_a_region = compiled_on_first_call(scaled_gelu, backend="eager")
    region = torch.compile(lambda x: first_in_a_region(x) + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(region(x), scaled_gelu(x) + 1)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    region(x)  # no graph more: the trace guarded nothing of the wrapper's own
    assert counters["stats"]["unique_graphs"] == 2
    first_in_a_region(torch.randn(3, 8))  # outside a region: compiled, as torch.compile's own
    assert counters["stats"]["unique_graphs"] == 3


def test_fused_dropout_statistics(compile_afresh):
    """megatron-core's compiled bias-dropout-add, with inductor's own random numbers (what
    training runs): out = residual + (x + bias) * mask / (1 - p), with a share p of elements
    dropped (within 5 binomial standard deviations), the gradient through the same mask, and a
    new mask at each call. That the mask differs from eager's under the same seed shows that the
    compiled code ran, not an eager fallback."""
    compile_afresh(fallback_random=False)
    p, shape = 0.1, (1024, 4, 256)  # [n, b, hidden]: 2^20 elements
    bias_dropout_add = fused_bias_dropout.get_bias_dropout_add(training=True, fused=True)
    assert bias_dropout_add is fused_bias_dropout.bias_dropout_add_fused_train
    generator = torch.Generator().manual_seed(0)
    # x + bias in [1, 3): a kept element always moves its residual, a dropped one leaves it
    x = (1 + torch.rand(shape, generator=generator)).requires_grad_()
    bias = torch.rand(shape[-1], generator=generator)
    residual = torch.randn(shape, generator=generator)

    torch.manual_seed(0)
    out = bias_dropout_add((x, bias), residual, p)
    assert counters["stats"]["unique_graphs"] == 1  # compiled by dynamo, in one graph
    assert not counters["graph_break"]
    kept = out != residual
    dropped_share = 1 - kept.double().mean().item()
    assert abs(dropped_share - p) <= 5 * math.sqrt(p * (1 - p) / kept.numel()), dropped_share
    torch.testing.assert_close(out, residual + (x + bias) * kept / (1 - p))
    out.sum().backward()
    torch.testing.assert_close(x.grad, kept / (1 - p))

    again = bias_dropout_add((x, bias), residual, p)
    assert not torch.equal(again != residual, kept)
    torch.manual_seed(0)
    eager = fused_bias_dropout.get_bias_dropout_add(training=True, fused=False)
    assert not torch.equal(eager((x, bias), residual, p) != residual, kept)


# (pos_encoding, padded batch, ModelConfig overrides): the CPU's layout (TUPE-R's terms in one
# mask) with attention and hidden dropout on, and CUDA's (TUPE-A's term as q/k columns padded to
# a multiple of 8, the padding as one more column)
BLOCK_CASES = [("tupe-r", True, dict(hidden_dropout=0.1, attention_dropout=0.1)),
               ("tupe-a", True, dict(untied_as_columns=True, head_multiple=8))]


@pytest.mark.parametrize("encoding, padded, overrides", BLOCK_CASES)
@pytest.mark.slow
def test_compiled_block_matches_eager(tiny_model, compile_afresh, encoding, padded, overrides):
    """The whole TransformerBlock as one compiled region gives eager's loss, logits and every
    gradient (1e-5): one graph for both layers, forward and backward, no graph break (the
    attention at tp 1 forks no generator, the row-parallel linears warn no more), and with
    dropout on the same masks (`fallback_random`: the compiled graph draws from eager's
    generator in eager's order, attention dropout included)."""
    compile_afresh(fallback_random=True)
    ids, mask, labels = inputs(padded=padded)
    eager = tiny_model(encoding, compile="none", **overrides)
    block = tiny_model(encoding, compile="block", **overrides)
    torch.manual_seed(1)
    expected_loss, expected_logits, expected_grads = loss_logits_grads(eager, ids, mask, labels)
    torch.manual_seed(1)
    loss, logits, grads = loss_logits_grads(block, ids, mask, labels)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_eager_layer_spends_no_call_on_unused_machinery(tiny_model, monkeypatch):
    """At tp 1 the attention draws dropout from the default generator (no state swap of the
    tensor-parallel tracker) and the row-parallel linears hand their group on (no warning a
    call): the Python work the compiled block would otherwise break on."""
    forks = []
    fork = parallel.AcceleratorRNGTracker.fork
    monkeypatch.setattr(parallel.AcceleratorRNGTracker, "fork",
                        lambda self, *a, **k: forks.append(1) or fork(self, *a, **k))
    model = tiny_model("tupe-r", compile="none", attention_dropout=0.1)
    layer = model.encoder.block.layers[0]
    assert isinstance(layer.self_attention.linear_proj, GroupedRowParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, GroupedRowParallelLinear)
    ids, mask, labels = inputs(padded=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(ids, mask, labels)[0].backward()
    assert not [w for w in caught if "tp_group" in str(w.message)]
    assert not forks


@pytest.mark.parametrize("device, tp, key_padding, mode", [
    ("cuda:0", 1, "auto", "block"), ("cuda:0", 2, "auto", "none"),
    ("cuda:0", 1, "unpadded", "none"), ("cpu", 1, "auto", "none")])
def test_compile_follows_the_device(monkeypatch, device, tp, key_padding, mode):
    """Left to itself (None): on CUDA the whole block where it is one region, else eager; eager
    on a CPU. A choice made is kept; without_block is eager where the block would be."""
    monkeypatch.setattr(config, "accelerator_device", lambda: torch.device(device))
    chosen = ModelConfig(tensor_parallel_size=tp, key_padding=key_padding)
    assert chosen.compile_mode == mode
    assert not chosen.fuses_elementwise
    assert ModelConfig(compile="elementwise").fuses_elementwise
    assert chosen.without_block().compile_mode == "none"
    assert ModelConfig(compile="elementwise").without_block().compile == "elementwise"


@pytest.mark.parametrize("overrides, words", [
    (dict(tensor_parallel_size=2), "collectives split"),
    (dict(key_padding="unpadded"), "nested tensors split"),
    (dict(compile="blocks"), "unknown compile 'blocks'")])
def test_compile_refused_where_it_would_not_be_one_region(overrides, words):
    with pytest.raises(ValueError, match=words):
        ModelConfig(**{"compile": "block", **overrides})


@pytest.mark.parametrize("fused, mode", [(True, "elementwise"), (False, "none"), (None, None)])
def test_records_of_earlier_versions_read(fused, mode):
    """run.json and exports of an earlier tupe_ds hold `fused_elementwise`."""
    assert ModelConfig.from_record({"fused_elementwise": fused}).compile == mode


@pytest.mark.parametrize("graph", ["forward", "backward"])
@pytest.mark.slow
def test_a_compile_that_fails_runs_eager_and_says_so(graph, tiny_model, compile_afresh,
                                                     monkeypatch, caplog):
    """Inductor failing on the forward or on the backward graph (as a Triton error or a kernel
    the device lacks would): the encoder runs eager from that forward on, with eager's loss and
    gradients, and one line names the error."""
    import torch._inductor.compile_fx as inductor
    compile_graph = inductor._compile_fx_inner

    def fails_on_one_graph(gm, example_inputs, **kwargs):
        if kwargs["is_backward"] == (graph == "backward"):
            raise RuntimeError("injected: no kernel for this device")
        return compile_graph(gm, example_inputs, **kwargs)

    compile_afresh(fallback_random=False)
    monkeypatch.setattr(inductor, "_compile_fx_inner", fails_on_one_graph)
    ids, mask, labels = inputs(padded=True)
    eager = tiny_model("tupe-r", compile="none")
    block = tiny_model("tupe-r", compile="block")
    expected_loss, _, expected_grads = loss_logits_grads(eager, ids, mask, labels)
    with caplog.at_level("WARNING", logger="tupe_ds.model.compiled"):
        loss, _, grads = loss_logits_grads(block, ids, mask, labels)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)
    region = block.encoder.region
    assert region.graphs.failure == "RuntimeError: injected: no kernel for this device"
    assert region.compiled is None

    def said():
        return [r.getMessage() for r in caplog.records if r.name == "tupe_ds.model.compiled"]
    assert said() == ["tupe_ds: torch.compile of the encoder failed (RuntimeError: injected: no "
                      "kernel for this device): it runs eager from here"]
    loss_logits_grads(block, ids, mask, labels)  # eager since: said once
    assert len(said()) == 1


@pytest.mark.slow
def test_a_run_compiles_one_graph_for_training_and_one_for_evaluation(tiny_model, compile_afresh,
                                                                      one_thread, caplog):
    """Padded batches and batches without padding (mask None), training and evaluation: two
    graphs, each said in one line; a batch without padding runs the padded graph with eager's
    result. A graph beyond the plan (here another batch size) is one warning naming the guard
    that failed."""
    compile_afresh(fallback_random=False)
    eager = tiny_model("bert-a", compile="none")
    block = tiny_model("bert-a", compile="block")
    padded, unpadded = inputs(padded=True), inputs(padded=False)
    unpadded = (unpadded[0], None, unpadded[2])
    with caplog.at_level("INFO", logger="tupe_ds.model.compiled"):
        for batch in (padded, unpadded, padded):
            loss, _, _ = loss_logits_grads(block, *batch)
            expected, _, _ = loss_logits_grads(eager, *batch)
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        block.eval()
        with torch.no_grad():
            for batch in (unpadded, padded):
                block(*batch)
    graphs = block.encoder.region.graphs
    assert graphs.count == 2 and graphs.seconds > 0
    said = [r.getMessage() for r in caplog.records if r.name == "tupe_ds.model.compiled"]
    assert len(said) == 2 and all(r.levelname == "INFO" for r in caplog.records
                                  if r.name == "tupe_ds.model.compiled")
    assert said[0].startswith("tupe_ds: compiled the training graph of the encoder in ")
    assert said[1].startswith("tupe_ds: compiled the evaluation graph of the encoder in ")

    caplog.clear()
    with caplog.at_level("INFO", logger="tupe_ds.model.compiled"), torch.no_grad():
        ids, mask, labels = inputs(padded=True, b=5)
        block(ids, mask, labels)
    assert graphs.count == 3
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1
    assert warned[0].startswith("tupe_ds: the encoder compiled graph 3, beyond the plan of 2 "
                                "(training, evaluation): the guard that failed: ")
    assert "size" in warned[0] and "\n" not in warned[0], warned[0]


def test_inductor_cache_in_the_run_folder_unless_one_is_named(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from tupe_ds.model import compiled

    run = tmp_path / "run"
    for named in (None, "", default_cache_dir()):  # torch writes its default there itself
        if named is None:
            monkeypatch.delenv(compiled.CACHE_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(compiled.CACHE_VARIABLE, named)
        assert compiled.keep_compiled_in(str(run)) == str(run / "compile-cache")
    monkeypatch.setenv(compiled.CACHE_VARIABLE, str(tmp_path / "mine"))
    assert compiled.keep_compiled_in(str(run)) == str(tmp_path / "mine")


@pytest.mark.slow
def test_a_requeue_reuses_the_compile_kept_in_the_run_folder(data, tmp_path):
    """Two starts of a run with --compile block on two pipeline stages of two layers each, each
    start on a "node" whose own cache (its TMPDIR, where inductor's default lives) holds no graph
    (the first's is empty; the second's holds the C++ headers inductor precompiled on the first,
    which inductor keeps there whatever the cache: 7 CPU seconds not spent again): the second
    finds every graph the first compiled in RUN/compile-cache; each start compiles two graphs
    (the stage's layers share them; DeepSpeed's received activations need no gradient in
    evaluation), says each once (rank 0) and what the cache held."""
    run = tmp_path / "run"
    outputs = []
    for steps, node in ((2, "node-a"), (4, "node-b")):
        (tmp_path / node).mkdir()
        if node == "node-b":  # the headers node-a precompiled: no graph
            for headers in (tmp_path / "node-a").glob("torchinductor*/precompiled_headers"):
                shutil.copytree(headers, tmp_path / node / headers.parent.name / headers.name,
                                ignore=shutil.ignore_patterns("locks"))
        env = {**environment(), "TMPDIR": str(tmp_path / node)}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        result = subprocess.run(
            command("torchrun", 2, data, run, "--steps", str(steps), "--eval-interval", "2",
                    "--compile", "block", "--allow-training-changes", "--pp", "2",
                    "--zero-stage", "1", "--num-layers", "4"),
            env=env, capture_output=True, text=True, timeout=400)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        outputs.append(result.stdout)
        # but the C++ headers inductor precompiles on a CPU (always under its default folder)
        assert {path.name for path in (tmp_path / node).glob("torchinductor*/*")} <= {
            "precompiled_headers"}
    cache = run / "compile-cache"
    for output, held in zip(outputs, (0, 4)):
        said = [line for line in output.splitlines() if "compile" in line]
        assert [line.split(" in ")[0] for line in said] == [
            "tupe_ds: compiled the training graph of the encoder",
            "tupe_ds: compiled the evaluation graph of the encoder",
            "tupe-pretrain: torch.compile: 2 graphs"], said
        assert said[-1].endswith(f"inductor's cache {cache} held {held} of the 4 forward and "
                                 "backward graphs"), said[-1]


def test_an_unusable_cache_folder_falls_back_to_the_nodes(tmp_path, monkeypatch, caplog):
    """RUN/compile-cache a file (or a dangling link, or no permission): the node's cache, with a
    warning that says a start elsewhere compiles again."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from tupe_ds.model import compiled

    monkeypatch.delenv(compiled.CACHE_VARIABLE, raising=False)
    (tmp_path / "compile-cache").write_text("")
    with caplog.at_level("WARNING", logger="tupe_ds.model.compiled"):
        assert compiled.keep_compiled_in(str(tmp_path)) == default_cache_dir()
    assert [r.getMessage() for r in caplog.records] == [
        f"tupe_ds: inductor's cache cannot be {tmp_path / 'compile-cache'} ([Errno 17] File "
        f"exists: '{tmp_path / 'compile-cache'}'): this node's {default_cache_dir()} is used, "
        "and a start on another node compiles again"]


@pytest.mark.slow
def test_a_compile_that_fails_on_one_rank_is_said_by_that_rank_and_in_the_summary(tmp_path):
    """Inductor fails on rank 1 only (a node whose compiler or GPU does not work): rank 1 says so
    in one line of its own, and rank 0's summary names the rank that ran eager."""
    worker = os.path.join(ROOT, "tests", "support", "compile_failure_worker.py")
    env = {**environment(),
           "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"),
                                          os.path.join(ROOT, "tests", "support")])}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                             "2", "--master_port", free_port(), worker], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    failed = ("torch.compile of the encoder failed (RuntimeError: injected: no compiler on this "
              "node): it runs eager from here")
    assert [line for line in result.stderr.splitlines() if "tupe_ds: torch.compile" in line] == [
        f"rank 1: tupe_ds: {failed}"], result.stderr  # a warning: on stderr
    assert [line for line in lines if "failed" in line] == [
        "summary: torch.compile failed on rank 1 of 2, which ran eager from then on: "
        "RuntimeError: injected: no compiler on this node"], lines
    assert [line for line in lines if "compiled the" in line] == [
        line for line in lines if line.startswith("tupe_ds: compiled the training graph of the "
                                                  "encoder in ")]
