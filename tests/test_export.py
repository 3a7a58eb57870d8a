"""tupe-export: the consolidated model of a ZeRO-2, a tp=2 and a pp=2 run gives the live engine's
logits, and loads without DeepSpeed; the exported tokenizer adds [CLS]/[SEP] as the samples
had them."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from runs import CPU_CONFIG, ROOT, environment, free_port
from test_hf_export import assert_transformers_match, run_transformers
from tp_inputs import inputs
from tupe_ds.export.hf.convert import tokenizer_files
from tupe_ds.export.read import load_exported
from tupe_ds.export.write import export
from tupe_ds.tools.errors import ExportError

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = {"zero2": [], "tp2": ["--tp", "2"], "pp2": ["--pp", "2", "--zero-stage", "1"]}


def train_and_record_logits(data, out, *flags):
    """export_worker.py under the deepspeed launcher, 2 processes: 3 steps, a checkpoint, logits."""
    command = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
               "--master_port", free_port(), os.path.join(HERE, "support", "export_worker.py"),
               "--data", data,
               "--model", "tiny", "--ds-config", CPU_CONFIG, "--out", str(out), "--seq-len", "64",
               "--steps", "3", "--lr", "5e-3", "--warmup-steps", "1", *flags]
    env = {**environment(), "PYTHONPATH": os.pathsep.join([HERE, ROOT])}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(out / "live_logits.pt")


@pytest.fixture(scope="module")
def layouts(data, tmp_path_factory):
    """{layout: (its folder, the live engine's logits, transformers' result)}: each layout
    trained under the launcher and exported, then every export in one transformers process
    (one process start, not three); a layout whose training or export failed holds the error,
    raised by its own test, the others' tests unharmed."""
    root = tmp_path_factory.mktemp("layouts")
    made, jobs = {}, []
    for layout, flags in LAYOUTS.items():
        try:
            live = train_and_record_logits(data, root / layout / "run", *flags)
            export(str(root / layout / "run" / "checkpoints"), str(root / layout / "exported"))
        except Exception as error:  # noqa: BLE001  (raised again by the layout's test)
            made[layout] = error
            continue
        ids, mask, _ = inputs(batch=3, n=40, vocab=1000)
        torch.save({"ids": ids, "mask": mask, "logits": live}, root / layout / "live.pt")
        jobs.append({"job": "logits", "folder": str(root / layout / "exported"),
                     "inputs": str(root / layout / "live.pt")})
        made[layout] = (root / layout, live)
    results = iter(run_transformers(jobs, root) if jobs else [])
    return {layout: value if isinstance(value, Exception) else (*value, next(results))
            for layout, value in made.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.slow
def test_exported_model_gives_the_live_engines_logits(layouts, layout):
    if isinstance(layouts[layout], Exception):
        raise layouts[layout]
    folder, live, result = layouts[layout]
    model, config, kind = load_exported(str(folder / "exported"))
    assert (kind, config.tensor_parallel_size, config.dtype) == ("bert-mlm", 1, "fp32")
    model.eval()
    ids, mask, _ = inputs(batch=3, n=40, vocab=1000)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask), live, rtol=1e-5, atol=1e-5)
    assert_transformers_match(result)  # transformers' model gives the live engine's logits
    if layout == "zero2":  # the same folder loads where DeepSpeed cannot be imported
        code = ("import sys; sys.modules['deepspeed'] = None\n"
                "from tupe_ds.export.read import load_exported\n"
                f"model, config, kind = load_exported({str(folder / 'exported')!r})\n"
                "import torch; print(tuple(model(torch.ones(1, 8, dtype=torch.long)).shape))")
        result = subprocess.run([sys.executable, "-c", code], env=environment(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"(1, 8, {config.vocab_size})" in result.stdout


def test_export_errors_name_what_is_missing(tmp_path):
    with pytest.raises(ExportError, match="not a complete DeepSpeed checkpoint"):
        export(str(tmp_path), str(tmp_path / "out"))
    step = tmp_path / "run" / "checkpoints" / "step2"
    step.mkdir(parents=True)
    (step / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(ExportError, match="run.json: missing"):
        export(str(step), str(tmp_path / "out"))


def test_export_replaces_only_an_earlier_export(tmp_path, capsys, monkeypatch):
    """--out a run folder, a folder of exports or notes, an export with a file of the user's
    beside it, a file, the working directory, or one whose .tmp holds someone's files: refused
    before the checkpoint is read, nothing changed; an earlier export (either format, or a link
    to one) would be replaced."""
    from tupe_ds.export.formats import check_out
    from tupe_ds.export.write import main as export_main

    run = tmp_path / "run"
    (run / "checkpoints" / "step2").mkdir(parents=True)
    (run / "history.jsonl").write_text("{}\n")
    exports = tmp_path / "exports"
    (exports / "other-model").mkdir(parents=True)
    (exports / "notes.txt").write_text("important")
    hf = ("README.md", "config.json", "configuration_tupe.py", "model.safetensors",
          "modeling_tupe.py", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")
    beside = tmp_path / "beside"
    beside.mkdir()
    for name in (*hf, "eval_results.json"):
        (beside / name).write_text("{}")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    kept = tmp_path / "kept"
    (tmp_path / "kept.tmp").mkdir()
    (tmp_path / "kept.tmp" / "notes.txt").write_text("precious")
    results = tmp_path / "results"  # an earlier tupe-format export, and the user's file
    results.mkdir()
    (results / "config.json").write_text('{"kind": "bert-mlm", "model": {}}')
    for name in ("model.safetensors", "tokenizer.json", "results.txt"):
        (results / name).write_text("x")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for out, shown in ((run, "checkpoints, history.jsonl"), (exports, "notes.txt, other-model"),
                       (beside, "eval_results.json"), (a_file, "(it is a file)"),
                       (kept, f"{kept}.tmp holds notes.txt"), (results, "results.txt")):
        assert export_main([str(run / "checkpoints"), "--out", str(out)]) == 2
        assert f"--out {out}: " in capsys.readouterr().err
        with pytest.raises(ExportError, match=re.escape(shown)):
            export(str(run / "checkpoints"), str(out))
    monkeypatch.chdir(exports / "other-model")
    for out in (".", str(exports)):
        with pytest.raises(ExportError, match="is the working directory or a folder above it"):
            check_out(out)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    tupe = ("model.safetensors", "config.json", "vocab-32k.json")
    for files in (hf, tupe, ()):
        earlier = tmp_path / f"earlier-{len(files)}"
        earlier.mkdir()
        for name in files:  # a tupe config.json; a tokenizer file
            (earlier / name).write_text('{"kind": "bert-mlm", "model": {}, "added_tokens": []}')
        (tmp_path / f"link-{len(files)}").symlink_to(earlier)
        assert check_out(str(tmp_path / f"link-{len(files)}") + "/") == str(earlier)
        with pytest.raises(ExportError, match="not a complete DeepSpeed checkpoint"):
            export(str(tmp_path / "a-file"), str(earlier))  # got past --out's check


def test_exported_tokenizer_adds_cls_and_sep_as_the_samples_had_them(data, tmp_path):
    """AutoTokenizer on the exported tokenizer files: the pretraining tokenizer's ids inside
    "[CLS] a [SEP]" / "[CLS] a [SEP] b [SEP]" (b's part of type 1), and "[MASK]" taking the
    space before it, as a masked word's token held it."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer_files(os.path.join(data, "tokenizer.json"), str(tmp_path), max_length=64)
    exported = AutoTokenizer.from_pretrained(str(tmp_path))
    pretraining = Tokenizer.from_file(os.path.join(data, "tokenizer.json"))
    cls, sep = pretraining.token_to_id("[CLS]"), pretraining.token_to_id("[SEP]")

    def ids(text):
        return pretraining.encode(text, add_special_tokens=False).ids

    for a, b in [("Anne was not sorry.", "She walked on."), ("Yes", "no, not at all; never.")]:
        single = exported(a, return_token_type_ids=True)
        assert single["input_ids"] == [cls] + ids(a) + [sep]
        assert single["token_type_ids"] == [0] * (len(ids(a)) + 2)
        assert single["attention_mask"] == [1] * (len(ids(a)) + 2)
        pair = exported(a, b, return_token_type_ids=True)
        assert pair["input_ids"] == [cls] + ids(a) + [sep] + ids(b) + [sep]
        assert pair["token_type_ids"] == [0] * (len(ids(a)) + 2) + [1] * (len(ids(b)) + 1)
        assert pair["attention_mask"] == [1] * len(pair["input_ids"])
    her, mask = pretraining.token_to_id("Ġher"), pretraining.token_to_id("[MASK]")
    words = ids("She did not know what to say to her sister.")
    assert her in words
    assert exported("She did not know what to say to [MASK] sister.")["input_ids"] == (
        [cls] + [mask if i == her else i for i in words] + [sep])


def electra_logits(run, ids, mask):
    """The discriminator's replaced-token logits [b, n] and the generator's masked-LM logits
    [b, n, vocab] of an ELECTRA run's latest checkpoint, computed by tupe_ds at tp=1."""
    from tupe_ds.model.config import ModelConfig
    from tupe_ds.model.electra import build_electra
    from tupe_ds.model.layers import embed

    with open(run / "run.json") as f:
        configs = [ModelConfig(**{**m, "tensor_parallel_size": 1}) for m in json.load(f)["models"]]
    model = build_electra(tuple(configs)).eval()
    saved = torch.load(run / "checkpoints" / "step2" / "mp_rank_00_model_states.pt",
                       weights_only=False)["module"]
    missing, _ = model.load_state_dict(saved, strict=False)
    assert not [name for name in missing if not name.endswith("_extra_state")]
    with torch.no_grad():
        embedded = embed(model.embedding, ids, configs[0].max_position_embeddings)
        scores = model.discriminator_head(model.discriminator(embedded, mask == 0)).squeeze(-1)
        hidden = model.generator(model.generator_projection(embedded), mask == 0)
        generated = model.generator_head(hidden, model.embedding.word_embeddings.weight)
    return scores.t(), generated.transpose(0, 1)


@pytest.mark.slow
def test_electra_exports_its_discriminator(data, tmp_path):
    """The discriminator and the shared embedding become the exported encoder (for tupe_ds and
    transformers, with the replaced-token head); the generator too for transformers. (One
    process: ELECTRA's ZeRO partitions of 2 ranks are consolidated in test_loss_normalization.)"""
    from test_pretrain import train

    train(None, 1, data, tmp_path / "run", "--objective", "electra", "--steps", "2",
          "--eval-interval", "2")
    export(str(tmp_path / "run"), str(tmp_path / "exported"))
    export(str(tmp_path / "run"), str(tmp_path / "generator"), network="generator")
    ids, mask, _ = inputs(batch=3, n=40, vocab=1000)
    jobs = []
    live = electra_logits(tmp_path / "run", ids, mask)
    for network, logits in zip(("exported", "generator"), live):
        torch.save({"ids": ids, "mask": mask, "logits": logits}, tmp_path / f"{network}.pt")
        jobs.append({"job": "logits", "folder": str(tmp_path / network),
                     "inputs": str(tmp_path / f"{network}.pt")})
    for result, heads in zip(run_transformers(jobs, tmp_path), (4, 2)):  # tiny, tiny-generator
        assert_transformers_match(result, heads=heads)
    model, config, kind = load_exported(str(tmp_path / "exported"))
    assert kind == "electra-discriminator" and config.hidden_size == 64  # not the generator's 32
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step2" / "mp_rank_00_model_states.pt",
                       weights_only=False)["module"]
    exported = model.state_dict()
    for name, tensor in saved.items():
        if name.startswith("discriminator.") and torch.is_tensor(tensor):
            torch.testing.assert_close(exported["encoder." + name[len("discriminator."):]], tensor)
    torch.testing.assert_close(exported["embedding.word_embeddings.weight"],
                               saved["embedding.word_embeddings.weight"])
