"""What a transformers user does with a tupe-export folder, in a process where tupe_ds,
DeepSpeed and megatron-core cannot be imported (run with `python -I`).

    python -I hf_worker.py JOBS.json RESULTS.json

JOBS.json lists {"job": name, ...arguments}; RESULTS.json gets one result per job.
"""

import json
import sys

for unavailable in ("tupe_ds", "deepspeed", "megatron"):  # as if not installed
    sys.modules[unavailable] = None

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModel, AutoTokenizer  # noqa: E402

HEADS = {"bert-mlm": transformers.AutoModelForMaskedLM,
         "electra-generator": transformers.AutoModelForMaskedLM,
         "electra-discriminator": transformers.AutoModelForPreTraining}


def logits(folder, inputs):
    """The pretraining head's logits with SDPA and eager attention, and what the other Auto
    classes give for the same batch."""
    batch = torch.load(inputs)
    ids, mask = batch["ids"], batch["mask"]
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    kind = config.tupe_ds["kind"]
    tokens = config.tokenizer_vocab_size if kind != "electra-discriminator" else None
    result = {}
    for implementation in ("sdpa", "eager"):
        model = HEADS[kind].from_pretrained(folder, trust_remote_code=True,
                                            attn_implementation=implementation).eval()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True,
                        output_hidden_states=True)
        # the real vocabulary's logits; its padding rows are masked (the tupe_ds model's are not)
        result[implementation] = (out.logits[..., :tokens]
                                  - batch["logits"][..., :tokens]).abs().max().item()
    if tokens is not None:
        padding = out.logits[..., tokens:]
        result["padding_rows"] = [padding.shape[-1],
                                  bool((padding == torch.finfo(padding.dtype).min).all())]
    result["attentions"] = [list(a.shape) for a in out.attentions]
    result["hidden_states"] = len(out.hidden_states)
    base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        hidden = base(ids, mask).last_hidden_state
    result["base"] = (hidden - out.hidden_states[-1]).abs().max().item()
    for name, labels in (("SequenceClassification", torch.tensor([1] * len(ids))),
                         ("TokenClassification", torch.zeros_like(ids))):
        auto = getattr(transformers, f"AutoModelFor{name}")
        head = auto.from_pretrained(folder, trust_remote_code=True, num_labels=3)
        out = head(input_ids=ids, attention_mask=mask, labels=labels)
        result[name] = [list(out.logits.shape), bool(torch.isfinite(out.loss))]
    return result


def fill_mask(folder, text):
    """The fill-mask pipeline's predictions, and how AutoTokenizer (asked nothing about remote
    code) tokenizes the text."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    fill = transformers.pipeline("fill-mask", model=folder, trust_remote_code=True)
    return {"predictions": fill(text), "ids": tokenizer(text)["input_ids"],
            "tokens": tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])}


def finetune(folder, out, train, labels):
    """Three epochs of Trainer on AutoModelForSequenceClassification: the training set's loss
    before and after, and whether save_pretrained + from_pretrained gives the same logits."""
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, trust_remote_code=True, num_labels=2)
    examples = [{**tokenizer(text), "labels": label} for text, label in zip(train, labels)]
    arguments = transformers.TrainingArguments(
        output_dir=out, num_train_epochs=3, per_device_train_batch_size=8, learning_rate=1e-3,
        warmup_steps=0, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        per_device_eval_batch_size=32, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=examples,
                                   eval_dataset=examples, processing_class=tokenizer)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    model.save_pretrained(out + "/saved")
    tokenizer.save_pretrained(out + "/saved")
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(
        out + "/saved", trust_remote_code=True)
    batch = tokenizer(train[:8], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        difference = (model(**batch).logits - reloaded.eval()(**batch).logits).abs().max().item()
    return {"before": before, "after": after, "reloaded": difference}


def main(jobs_path, results_path):
    with open(jobs_path) as f:
        jobs = json.load(f)
    results = [globals()[job.pop("job")](**job) for job in jobs]
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
