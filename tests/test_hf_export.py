"""tupe-export --format hf: every encoding loads with transformers' Auto classes in a process
where tupe_ds cannot be imported (tests/support/hf_worker.py) and gives the tupe_ds model's logits; the
fill-mask pipeline, Trainer and tupe-finetune work on the folders; the export's limits (trained
sequence length, vocabulary padding, finite fp16 masks); bad input is one line."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

import tupe_ds
from runs import environment
from topic_corpus import topic_words
from test_finetune import write_sentiment
from tp_inputs import inputs
from tupe_ds.data.loader import Vocabulary
from tupe_ds.data.masking import BERT_MASKING, MaskedSamples
from tupe_ds.data.packing import PackedSentences
from tupe_ds.export.formats import save_exported
from tupe_ds.export.read import load_exported
from tupe_ds.export.write import main as export_main
from tupe_ds.finetune.run import main as finetune_main
from tupe_ds.model.config import ENCODINGS

HERE = os.path.dirname(os.path.abspath(__file__))


def run_transformers(jobs, tmp_path):
    """tests/support/hf_worker.py's results for `jobs`, in a fresh `python -I` (no tupe_ds)."""
    jobs_path, results_path = tmp_path / "jobs.json", tmp_path / "results.json"
    jobs_path.write_text(json.dumps(jobs))
    env = {**environment(), "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "PYTHONPATH": ""}
    result = subprocess.run([sys.executable, "-I", os.path.join(HERE, "support", "hf_worker.py"),
                             str(jobs_path), str(results_path)], env=env, capture_output=True,
                            text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(results_path.read_text())


def pretrained(data, encoding, steps, lr=1e-3, batch=16):
    """A tiny model after `steps` AdamW steps on the bundled corpus's masked-LM stream."""
    torch.manual_seed(0)
    vocab = Vocabulary.from_data_dir(data)
    packed = PackedSentences(os.path.join(data, "train"), 64, vocab.cls, vocab.sep, data)
    samples = MaskedSamples(packed, vocab, BERT_MASKING, seed=1)
    model = tupe_ds.build_model("tiny", pos_encoding=encoding, vocab_size=1024)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        samples_ = samples.global_samples(step * batch, batch)
        loss, _ = model(samples_["input_ids"], samples_["attention_mask"], samples_["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def export_with_logits(model, data, folder, format="hf"):
    """`folder` exported from `model`, and FOLDER.pt: a padded batch and the model's logits."""
    state = {n: t for n, t in model.state_dict().items() if torch.is_tensor(t)}
    save_exported(str(folder), state, model.model_config, "bert-mlm",
                  os.path.join(data, "tokenizer.json"), source="test", format=format)
    ids, mask, _ = inputs(batch=3, n=40, vocab=1000)
    with torch.no_grad():
        logits = model(ids, mask)
    torch.save({"ids": ids, "mask": mask, "logits": logits}, f"{folder}.pt")
    return logits


TOKENS = 1000  # the data fixture's vocabulary; the tiny models' embedding has 1024 rows
RELATIVE_BIAS = "encoder.positional.relative.relative_attention_bias.weight"


def assert_transformers_match(result, layers=2, heads=4, n=40):
    assert result["sdpa"] < 1e-5 and result["eager"] < 1e-5, result
    assert result.get("padding_rows") in (None, [1024 - TOKENS, True])  # None: no MLM head
    assert result["base"] < 1e-5 and result["hidden_states"] == layers + 1
    assert result["attentions"] == [[3, heads, n, n]] * layers
    assert result["SequenceClassification"] == [[3, 3], True]
    assert result["TokenClassification"] == [[3, n, 3], True]


@pytest.mark.slow
def test_every_encoding_loads_in_transformers_with_the_same_logits(data, tmp_path):
    jobs = []
    for encoding in ENCODINGS:
        model = pretrained(data, encoding, steps=3)
        logits = export_with_logits(model, data, tmp_path / encoding)
        reloaded, config, kind = load_exported(str(tmp_path / encoding))  # tupe_ds reads it too
        with torch.no_grad():
            torch.testing.assert_close(reloaded.eval()(*inputs(3, 40, 1000)[:2]), logits,
                                       rtol=0, atol=1e-6)
        jobs.append({"job": "logits", "folder": str(tmp_path / encoding),
                     "inputs": f"{tmp_path / encoding}.pt"})
    results = run_transformers(jobs, tmp_path)
    assert len(results) == len(ENCODINGS)
    for result in results:
        assert_transformers_match(result)
    files = sorted(os.listdir(tmp_path / "tupe-r"))
    assert files == ["README.md", "config.json", "configuration_tupe.py", "model.safetensors",
                     "modeling_tupe.py", "special_tokens_map.json", "tokenizer.json",
                     "tokenizer_config.json"]
    config = json.loads((tmp_path / "tupe-r" / "config.json").read_text())
    assert config["model_type"] == "tupe" and config["encoding"]["untied"] is True
    assert config["seq_length"] == 64 and config["tokenizer_vocab_size"] == TOKENS


@pytest.mark.slow
def test_fill_mask_and_trainer_after_a_short_pretraining(topic_data, tmp_path):
    """On test_demo_learns' topic corpus, where a masked word follows from the other words of its
    document (on the bundled novel a tiny model predicts punctuation at a masked word for its
    first 600 steps: 800 steps, 100 CPU seconds, where these 100 take 12), the fill-mask
    pipeline's top word is one of the masked word's topic (30 documents of 30 after 50 steps,
    2026-12-03), and Trainer fine-tunes the export on a task in the corpus's words."""
    model = pretrained(topic_data, "tupe-r", steps=100, lr=3e-3, batch=32)
    export_with_logits(model, topic_data, tmp_path / "model")
    topics = topic_words(random.Random(0))  # topic_data's words
    # a sentiment task in the corpus's words: one word of topic 0 (positive) or 1 among filler
    filler = [word for words in topics[4:] for word in words]
    rng = random.Random(0)
    texts, labels = [], []
    for _ in range(160):
        label = rng.randrange(2)
        words = rng.sample(filler, 5) + [rng.choice(topics[0] if label else topics[1])]
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(label)
    topic = topics[3]
    answer = topic[2]  # once in the text, at the mask
    text = " ".join([topic[0], topic[1], topic[3], topic[0], "[MASK]", topic[1], topic[3]])
    masked, trained = run_transformers(
        [{"job": "fill_mask", "folder": str(tmp_path / "model"), "text": text},
         {"job": "finetune", "folder": str(tmp_path / "model"), "out": str(tmp_path / "trainer"),
          "train": texts, "labels": labels}], tmp_path)
    top = masked["predictions"][0]["token_str"].strip()
    assert top in topic, (topic, masked["predictions"][:3])
    # "[MASK]" takes the space before it, as a masked word's token held it in pretraining
    from tokenizers import Tokenizer
    pretraining = Tokenizer.from_file(os.path.join(topic_data, "tokenizer.json"))
    ids = pretraining.encode(text.replace("[MASK]", answer), add_special_tokens=False).ids
    word = pretraining.token_to_id("Ġ" + answer)
    assert ids.count(word) == 1
    expected = [2] + [pretraining.token_to_id("[MASK]") if i == word else i for i in ids] + [3]
    assert masked["ids"] == expected, masked["tokens"]
    assert trained["after"] < 0.95 * trained["before"], trained  # three epochs of 20 steps
    assert trained["reloaded"] < 1e-6, trained


def test_exports_limit_length_mask_vocabulary_padding_and_stay_finite_in_fp16(data, tmp_path):
    """Inputs past the pretraining's sequence length are refused (the tokenizer truncates
    there); the vocabulary's padding rows are never predicted; a row of padding only gives
    finite fp16 logits with eager attention and SDPA, for encodings with a positional mask and
    a causal one."""
    from transformers import PreTrainedTokenizerFast
    from tupe_ds.export.hf.modeling_tupe import TupeForMaskedLM

    for encoding in ("bert-r", "tupe-r", "mask-nope"):
        torch.manual_seed(0)
        model = tupe_ds.build_model("tiny", pos_encoding=encoding, vocab_size=1024,
                                    seq_length=32, hidden_dropout=0.0, attention_dropout=0.0)
        state = {n: t for n, t in model.state_dict().items() if torch.is_tensor(t)}
        if RELATIVE_BIAS in state:  # v = -100: v + fp16's minimum was -inf (bert-r: a NaN row)
            state[RELATIVE_BIAS] = torch.full_like(state[RELATIVE_BIAS], -100.0)
        folder = tmp_path / encoding
        save_exported(str(folder), state, model.model_config, "bert-mlm",
                      os.path.join(data, "tokenizer.json"), source="test")
        card = (folder / "README.md").read_text()
        assert "Pretrained on sequences of 32 tokens" in card and "24 rows after them" in card
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
        assert tokenizer.model_max_length == 32
        assert len(tokenizer("word " * 100, truncation=True)["input_ids"]) == 32
        ids, mask, _ = inputs(batch=3, n=32, vocab=1000)
        mask[1] = 0  # padding only
        for implementation in ("eager", "sdpa"):
            exported = TupeForMaskedLM.from_pretrained(
                str(folder), attn_implementation=implementation, dtype=torch.float16).eval()
            with torch.no_grad():
                logits = exported(input_ids=ids, attention_mask=mask).logits
            assert logits.dtype == torch.float16 and logits.isfinite().all(), implementation
            assert (logits[..., TOKENS:] == torch.finfo(torch.float16).min).all()
            assert logits.argmax(-1).max() < TOKENS
            with pytest.raises(ValueError, match="beyond the 32 the model was pretrained on"):
                exported(input_ids=torch.ones(1, 33, dtype=torch.long))
        exported.config.seq_length = None  # the way out the error names
        with torch.no_grad():
            assert exported(input_ids=torch.ones(1, 33, dtype=torch.long)).logits.shape[1] == 33


@pytest.mark.slow
def test_tupe_finetune_reads_both_folder_kinds(data, tmp_path):
    sentiment = write_sentiment(tmp_path / "train.tsv", 48, 1)
    for format in ("hf", "tupe"):
        model = pretrained(data, "bert-a", steps=1)
        export_with_logits(model, data, tmp_path / format, format=format)
        assert finetune_main(["--model", str(tmp_path / format), "--task", "sst2", "--train",
                              sentiment, "--valid", f"dev={sentiment}", "--out",
                              str(tmp_path / f"out-{format}"), "--lr", "1e-3", "--seeds", "1",
                              "--epochs", "1", "--batch-size", "16", "--max-length", "24"]) == 0
        assert os.path.exists(tmp_path / f"out-{format}" / "results.json")


def one_line_error(main, argv, capsys):
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error, error
    return error


def test_bad_input_is_one_line_that_says_what_to_do(data, tmp_path, capsys):
    finetune = ["--task", "sst2", "--train", "x.tsv", "--valid", "x.tsv", "--out",
                str(tmp_path / "out")]
    (tmp_path / "notes").mkdir()
    assert "not a tupe-export folder (no config.json); tupe-export RUN_DIR --out DIR" in \
        one_line_error(finetune_main, ["--model", str(tmp_path / "notes"), *finetune], capsys)
    step = tmp_path / "run" / "checkpoints" / "step2"
    step.mkdir(parents=True)
    (step / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert "run.json: missing; tupe-pretrain writes it" in \
        one_line_error(export_main, [str(step), "--out", str(tmp_path / "x")], capsys)
    (tmp_path / "run" / "run.json").write_text('{"objective": "mlm"}')
    assert "run.json: not a run description tupe-pretrain wrote (data is missing" in \
        one_line_error(export_main, [str(step), "--out", str(tmp_path / "x")], capsys)
    (tmp_path / "run" / "run.json").write_text(
        '{"objective": "mlm", "data": "prep", "tp": 1, "pp": 1, "models": [{}]}')
    assert "only an ELECTRA run's generator, in --format hf, can be exported" in one_line_error(
        export_main, [str(step), "--out", str(tmp_path / "x"), "--electra-network", "generator"],
        capsys)
    model = pretrained(data, "nope", steps=0)
    export_with_logits(model, data, tmp_path / "old", format="tupe")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config["model"]["pos_encoding"] = "tupe-x"
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    error = one_line_error(finetune_main, ["--model", str(tmp_path / "old"), *finetune], capsys)
    assert "unknown encoding 'tupe-x'" in error and "export the checkpoint again" in error
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    assert "a transformers 'bert' model, not one tupe-export wrote" in \
        one_line_error(finetune_main, ["--model", str(tmp_path / "bert"), *finetune], capsys)
