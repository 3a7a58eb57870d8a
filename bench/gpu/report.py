"""bench/gpu/step_time.py's verdicts (the issue's ratios with their targets) and its report, as markdown:
the header, the step-time table, the verdicts, the operators ours has more of than HF's, the
host synchronisations, the ELECTRA pair and the ZeRO sweep."""

from importlib.metadata import version

import deepspeed
import torch

from bench.gpu.markdown import table, verdict, verdict_table
from bench.gpu.measure import HF, machine_name, ours_name
from bench.gpu.runners import PADDINGS

ELECTRA_TARGET = 1.5  # ELECTRA step time at most this times BERT's of the discriminator's size


def target_seq(settings) -> int:
    """The step-time targets are for seq 512; without 512 in --seqs, the longest measured."""
    return 512 if 512 in settings.seqs else max(settings.seqs)


def table_verdicts(settings, rows: list) -> list:
    """Per seq and padding: ours / HF samples/s >= 1.1; tupe-a, tupe-r / bert-a step time <= 1.05,
    1.15 (at target_seq; elsewhere informational); bert-a's, tupe-r's operators <= HF's (rows
    with operator counts). Each verdict whose rows were measured (suite.py skips what does not
    fit its time budget)."""
    by = {(r["model"], r["seq"], r["padding"]): r for r in rows}
    out = []
    for seq in settings.seqs:
        for padding in settings.padding:
            where = dict(seq=seq, padding=padding)
            hf = by.get((HF, seq, padding))
            if hf is None:
                continue
            for attention in settings.attention:
                names = {e: ours_name(settings, e, attention) for e in settings.encodings}
                ours = {e: by[(name, seq, padding)] for e, name in names.items()
                        if (name, seq, padding) in by}
                for encoding, row in ours.items():
                    out.append(verdict(f"{names[encoding]} / {HF} samples/s",
                                       row["samples_per_s"] / hf["samples_per_s"], 1.1, False,
                                       **where))
                for encoding, target in (("tupe-a", 1.05), ("tupe-r", 1.15)):
                    if "bert-a" in ours and encoding in ours:
                        ratio = ours[encoding]["ms_per_step"] / ours["bert-a"]["ms_per_step"]
                        out.append(verdict(
                            f"{names[encoding]} / {names['bert-a']} step time", ratio,
                            target if seq == target_seq(settings) else None, True, **where))
                for encoding in ("bert-a", "tupe-r"):
                    if encoding in ours and "ops" in ours[encoding] and "ops" in hf:
                        ops = ours[encoding]["ops"]
                        out.append({**verdict(f"{names[encoding]} / {HF} ops per step",
                                              ops / hf["ops"], 1.0, True, **where),
                                    "detail": f" ({ops} / {hf['ops']})"})
    return out


def electra_verdicts(electra: list) -> list:
    """Per padding: ELECTRA's step time over BERT's of its discriminator's size <= 1.5. The rows
    come in pairs, ELECTRA then its BERT, one pair per padding (run_electra's order)."""
    out = []
    for first, second in zip(electra[::2], electra[1::2]):
        out.append(verdict(f"{first['model']} / {second['model']} step time",
                           first["ms_per_step"] / second["ms_per_step"], ELECTRA_TARGET, True,
                           seq=first["seq"], padding=first["padding"]))
    return out


def result_verdicts(settings, result: dict) -> list:
    """The verdicts of bench/gpu/step_time.py's result: the table's, then the ELECTRA pair's."""
    return table_verdicts(settings, result["rows"]) + electra_verdicts(result["electra"])


def step_table(settings, rows: list) -> list:
    hf = {(r["seq"], r["padding"]): r for r in rows if r["model"] == HF}
    header = ["row", "seq", "micro x acc", "ms/step", "min ms", "samples/s", "TFLOPS", "MFU",
              "ops/step"] + (["launches", "peak GiB", "host syncs"] if settings.cuda else [])
    lines = []
    for r in rows:  # the counts: "-" in the rows of an unprofiled padding (--profiled-paddings)
        cuda = ([r.get("launches", "-"), f"{r['peak_gib']:.1f}", r.get("syncs", "-")]
                if settings.cuda else [])
        lines.append([r["name"], r["seq"], f"{r['micro_batch']} x {r['accumulation']}",
                      f"{r['ms_per_step']:.1f}", f"{r['min_ms']:.1f}",
                      f"{r['samples_per_s']:.1f}", f"{r['tflops']:.3g}", f"{r['mfu']:.1%}",
                      r.get("ops", "-")] + cuda)
    out = table(header + ["samples/s / HF's"], [
        line + [f"{r['samples_per_s'] / hf[(r['seq'], r['padding'])]['samples_per_s']:.3f}"]
        for line, r in zip(lines, rows)])
    skipped = [f"{r['name']} seq {r['seq']}: {r['skipped_steps']}" for r in rows
               if r.get("skipped_steps")]
    if skipped:
        out += ["", "Optimizer steps DeepSpeed skipped (fp16 overflow; warm-up and timed steps): "
                + ", ".join(skipped)]
    return out


def op_excess(rows: list) -> list:
    """Where bert-a's and tupe-r's steps have more operators than HF's: the largest excesses
    (profiled rows)."""
    hf = {(r["seq"], r["padding"]): r["op_names"] for r in rows
          if r["model"] == HF and "op_names" in r}
    lines = []
    for r in rows:
        if r["model"].split("/")[0] in ("bert-a", "tupe-r") and "op_names" in r:
            theirs = hf[(r["seq"], r["padding"])]
            excess = {name: count - theirs.get(name, 0) for name, count in r["op_names"].items()
                      if count > theirs.get(name, 0)}
            top = sorted(excess.items(), key=lambda kv: -kv[1])[:8]
            lines.append([r["name"], r["seq"], ", ".join(
                f"{name[len('aten::'):]} +{count}" for name, count in top)])
    return table(["row", "seq", f"leaf aten operators above {HF}'s (ours - HF's)"], lines)


def sync_lines(settings, rows: list) -> list:
    if not settings.cuda:
        return ["Host synchronisations: not counted, this needs CUDA."]
    lines = [[r["name"], r["seq"], r["syncs"], ", ".join(
        f"{where} x{n}" for where, n in list(r["sync_locations"].items())[:6])] for r in rows
        if "syncs" in r]
    return table(["row", "seq", "host syncs in one step", "by the first frame outside torch"],
                 lines)


def electra_lines(settings, electra: list) -> list:
    out = [f"ELECTRA against BERT of its discriminator's size ({settings.electra_encoding}, "
           f"tupe_ds.pretrain's step with its metrics, shipped configs, seq {electra[0]['seq']}, "
           f"global batch {settings.global_batch}):", ""]
    out += table(["row", "config", "micro x acc", "ms/step", "samples/s", "ops", "host syncs",
                  "device busy ms", "phases of one profiled step: host ms (calls)"], [
        [r["name"], r["config"], f"{r['micro_batch']} x {r['accumulation']}",
         f"{r['ms_per_step']:.1f}", f"{r['samples_per_s']:.1f}", r.get("ops", "-"),
         r.get("syncs", "-"),
         f"{r['device_busy_ms']:.1f}" if "device_busy_ms" in r else "-",
         ", ".join(f"{name} {p['host_ms']:.1f} ({p['calls']})"
                   for name, p in r.get("phases", {}).items())] for r in electra])
    return out


def sweep_lines(settings, sweep: list) -> list:
    micros = settings.sweep_micro_batches
    cells = {(r["zero_stage"], r["micro_batch"]): r for r in sweep}
    best = max(sweep, key=lambda r: r["samples_per_s"])
    return [f"ZeRO stage x micro-batch, bert-a at seq {sweep[0]['seq']}, "
            f"{PADDINGS[sweep[0]['padding']]}, global batch {settings.global_batch}: "
            "samples/s (TFLOPS)", ""] + table(
        ["ZeRO stage"] + [f"micro {m}" for m in micros],
        [[stage] + [f"{cells[(stage, m)]['samples_per_s']:.1f} "
                    f"({cells[(stage, m)]['tflops']:.3g})" if (stage, m) in cells else "-"
                    for m in micros]
         for stage in settings.sweep_zero_stages]) + [
        "", f"Fastest: ZeRO stage {best['zero_stage']}, micro-batch {best['micro_batch']} "
            f"({best['samples_per_s']:.1f} samples/s)."]


def ours_optimizer(config: dict) -> str:
    params = config["optimizer"].get("params", {})
    if params.get("torch_adam"):
        return f"torch {config['optimizer']['type']}" + (" (fused)" if params.get("fused") else "")
    return f"{config['optimizer']['type']} (DeepSpeed's FusedAdam)"


def header(settings, config: dict) -> dict:
    threads = "" if settings.cuda else f", {torch.get_num_threads()} torch threads"
    hf_precision = f"torch AMP {settings.dtype}" if settings.dtype != "fp32" else "fp32"
    fused = " (fused)" if settings.fused_adamw else " (not fused: unsupported here)"
    return {
        "machine": f"{machine_name(settings)}; device {settings.device}{threads}",
        "versions": f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, megatron-core "
                    f"{version('megatron-core')}, transformers {version('transformers')}",
        "size": f"{settings.layers} layers, hidden {settings.hidden}, {settings.heads} heads, FFN "
                f"{settings.ffn}, vocab {settings.vocab}; global batch {settings.global_batch}, "
                f"seqs {settings.seqs}, micro-batches {settings.micro_batches}; padding: "
                + ", ".join(PADDINGS[p] for p in settings.padding),
        "precision": f"{settings.dtype}; attention {', '.join(settings.attention)}",
        "ours": f"{settings.ds_config}, ZeRO stage "
                f"{config.get('zero_optimization', {}).get('stage', 0)}, optimizer "
                f"{ours_optimizer(config)}, gradient clipping "
                f"{config.get('gradient_clipping', 1.0)}",
        "HF": f"BertForMaskedLM sdpa, {hf_precision}, torch AdamW{fused}, same clipping",
        "timing": f"median of {settings.steps} optimizer steps after {settings.warmup} warm-up, "
                  "one model at a time",
        "peak": f"plain {settings.matmul_n}^3 {settings.dtype if settings.cuda else 'fp32'} "
                f"matmul: {settings.peak_flops / 1e12:.2f} TFLOPS",
    }


def report(settings, result: dict) -> str:
    """The whole report of one run of bench/gpu/step_time.py (`result` as its JSON holds it)."""
    lines = [f"- {key}: {value}" for key, value in result["header"].items()]
    lines += ["", *step_table(settings, result["rows"]), "",
              f"Verdicts (informational: the exit code is 0 either way; step-time targets at "
              f"seq {target_seq(settings)}):", "", *verdict_table(result["verdicts"]), "",
              *op_excess(result["rows"]), "",
              *sync_lines(settings, result["rows"] + result["electra"])]
    if result["electra"]:
        lines += ["", *electra_lines(settings, result["electra"])]
    if result["sweep"]:
        lines += ["", *sweep_lines(settings, result["sweep"])]
    return "\n".join(lines) + "\n"
