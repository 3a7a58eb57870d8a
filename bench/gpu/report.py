"""bench/gpu/step_time.py's verdicts (the issue's ratios with their targets) and its report, as markdown:
the header, the step-time table, the verdicts, the operators ours has more of than HF's, the
host synchronisations, the ELECTRA pair and the ZeRO sweep."""

from importlib.metadata import version

import deepspeed
import torch

from bench.gpu.markdown import table, verdict, verdict_table
from bench.gpu.measure import HF, machine_name, ours_name
from bench.gpu.runners import PADDINGS, model_config

ELECTRA_TARGET = 1.5  # ELECTRA step time at most this times BERT's of the discriminator's size
MFU_TARGET = 0.40  # bert-a at its best, of the plain matmul's FLOP/s (CUDA)
DOES_NOT_FIT = "does not fit (out of memory)"


def target_seq(settings) -> int:
    """The step-time targets are for seq 512; without 512 in --seqs, the longest measured."""
    return 512 if 512 in settings.seqs else max(settings.seqs)


def fitting(rows: list) -> list:
    """The rows whose micro-batch fit in memory (rows of runs before the sweep all did)."""
    return [r for r in rows if r.get("fits", True)]


def best_rows(rows: list) -> dict:
    """{(model, seq, padding): its fastest row that fits}."""
    best = {}
    for r in fitting(rows):
        key = (r["model"], r["seq"], r["padding"])
        if key not in best or r["samples_per_s"] > best[key]["samples_per_s"]:
            best[key] = r
    return best


def like_for_like_micro(settings, seq: int) -> int:
    return settings.micro_batches[settings.seqs.index(seq)]


def table_verdicts(settings, rows: list) -> list:
    """Per seq and padding, each verdict whose rows were measured (suite.py skips what does not
    fit its time budget): the headline, ours at its best / HF at its best samples/s >= 1.1 (each
    model's fastest micro-batch that fits); bert-a's MFU at its best >= 40% (CUDA); at the
    like-for-like micro-batch (--micro-batches, the same for every model): ours / HF samples/s
    (informational), tupe-a, tupe-r / bert-a step time <= 1.05, 1.15 (at target_seq; elsewhere
    informational), bert-a's and tupe-r's operators <= HF's (profiled rows)."""
    best = best_rows(rows)
    same = {(r["model"], r["seq"], r["padding"]): r for r in fitting(rows)
            if r["micro_batch"] == like_for_like_micro(settings, r["seq"])}
    out = []
    for seq in settings.seqs:
        for padding in settings.padding:
            where = dict(seq=seq, padding=padding)
            micro = like_for_like_micro(settings, seq)
            for attention in settings.attention:
                names = {e: ours_name(settings, e, attention) for e in settings.encodings}
                hf_best = best.get((HF, seq, padding))
                for encoding, name in names.items():
                    ours = best.get((name, seq, padding))
                    if ours and hf_best:
                        out.append({**verdict(
                            f"{name} at its best / {HF} at its best samples/s",
                            ours["samples_per_s"] / hf_best["samples_per_s"], 1.1, False,
                            **where), "detail": f" (micro-batch {ours['micro_batch']} / "
                                                f"{hf_best['micro_batch']})"})
                    if ours and encoding == "bert-a":
                        out.append({**verdict(f"{name} at its best MFU", ours["mfu"],
                                              MFU_TARGET if settings.cuda else None, False,
                                              **where),
                                    "detail": f" (micro-batch {ours['micro_batch']})"})
                ours = {e: same[(name, seq, padding)] for e, name in names.items()
                        if (name, seq, padding) in same}
                hf = same.get((HF, seq, padding))
                for encoding, row in ours.items():
                    if hf:
                        out.append(verdict(f"{names[encoding]} / {HF} samples/s, micro-batch "
                                           f"{micro} both", row["samples_per_s"]
                                           / hf["samples_per_s"], None, False, **where))
                for encoding, target in (("tupe-a", 1.05), ("tupe-r", 1.15)):
                    if "bert-a" in ours and encoding in ours:
                        ratio = ours[encoding]["ms_per_step"] / ours["bert-a"]["ms_per_step"]
                        out.append(verdict(
                            f"{names[encoding]} / {names['bert-a']} step time", ratio,
                            target if seq == target_seq(settings) else None, True, **where))
                for encoding in ("bert-a", "tupe-r"):
                    if hf and encoding in ours and "ops" in ours[encoding] and "ops" in hf:
                        ops = ours[encoding]["ops"]
                        out.append({**verdict(f"{names[encoding]} / {HF} ops per step",
                                              ops / hf["ops"], 1.0, True, **where),
                                    "detail": f" ({ops} / {hf['ops']})"})
    return out


def electra_verdicts(electra: list) -> list:
    """Per padding: ELECTRA's step time over BERT's of its discriminator's size <= 1.5, each at
    its fastest micro-batch that fits (ELECTRA first: electra_builds' order)."""
    best = best_rows(electra)
    models = list(dict.fromkeys(r["model"] for r in electra))
    out = []
    for padding in dict.fromkeys(r["padding"] for r in electra):
        first, second = (best.get((model, electra[0]["seq"], padding)) for model in models)
        if first and second:
            out.append({**verdict(f"{first['model']} / {second['model']} step time",
                                  first["ms_per_step"] / second["ms_per_step"], ELECTRA_TARGET,
                                  True, seq=first["seq"], padding=padding),
                        "detail": f" (micro-batch {first['micro_batch']} / "
                                  f"{second['micro_batch']})"})
    return out


def result_verdicts(settings, result: dict) -> list:
    """The verdicts of bench/gpu/step_time.py's result: the table's, then the ELECTRA pair's."""
    return table_verdicts(settings, result["rows"]) + electra_verdicts(result["electra"])


def display_order(settings, rows: list) -> list:
    """The rows by seq, padding, model (HF first) and micro-batch, whatever order they were
    measured in."""
    models = [HF] + [ours_name(settings, e, a) for a in settings.attention
                     for e in settings.encodings]
    return sorted(rows, key=lambda r: (r["seq"], settings.padding.index(r["padding"]),
                                       models.index(r["model"]), r["micro_batch"]))


def fraction(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def step_table(settings, rows: list) -> list:
    rows = display_order(settings, rows)
    best = best_rows(rows)
    hf_at = {(r["seq"], r["padding"], r["micro_batch"]): r for r in fitting(rows)
             if r["model"] == HF}
    header = ["row", "seq", "micro x acc", "compile", "ms/step", "min ms", "samples/s", "TFLOPS",
              "MFU", "ops/step"] + (["launches", "device busy", "peak GiB", "host syncs"]
                                    if settings.cuda else []) + [
              "first warm-up step s", "samples/s / HF's, same micro-batch", "/ HF's best"]
    lines = []
    for r in rows:  # the counts: "-" in the rows of an unprofiled padding (--profiled-paddings)
        shape = [r["name"], r["seq"], f"{r['micro_batch']} x {r['accumulation']}"]
        if not r.get("fits", True):
            lines.append(shape + [DOES_NOT_FIT] + [""] * (len(header) - 4))
            continue
        cuda = ([r.get("launches", "-"), fraction(r.get("device_busy_fraction")),
                 f"{r['peak_gib']:.1f}", r.get("syncs", "-")] if settings.cuda else [])
        same = hf_at.get((r["seq"], r["padding"], r["micro_batch"]))
        hf_best = best.get((HF, r["seq"], r["padding"]))
        lines.append(shape + [
            r.get("compile") or "-", f"{r['ms_per_step']:.1f}", f"{r['min_ms']:.1f}",
            f"{r['samples_per_s']:.1f}", f"{r['tflops']:.3g}", f"{r['mfu']:.1%}",
            r.get("ops", "-")] + cuda + [
            f"{r['warmup_s'][0]:.1f}" if r.get("warmup_s") else "-",
            f"{r['samples_per_s'] / same['samples_per_s']:.3f}" if same else "-",
            f"{r['samples_per_s'] / hf_best['samples_per_s']:.3f}" if hf_best else "-"])
    out = table(header, lines)
    skipped = [f"{r['name']} seq {r['seq']} micro {r['micro_batch']}: {r['skipped_steps']}"
               for r in rows if r.get("skipped_steps")]
    if skipped:
        out += ["", "Optimizer steps DeepSpeed skipped (fp16 overflow; warm-up and timed steps): "
                + ", ".join(skipped)]
    return out


def phase_lines(settings, rows: list) -> list:
    """Host ms against device ms per phase of one step (bench/gpu/phases.py), profiled rows."""
    rows = [r for r in display_order(settings, rows) if "phase_ms" in r]
    if not rows:
        return []
    kinds = ["host_ms", "device_ms"] if settings.cuda else ["host_ms"]
    columns = ("forward", "backward", "boundary", "step")
    header = ["row", "seq", "micro x acc"] + [
        f"{kind.split('_')[0]} ms: {column}" for kind in kinds for column in columns]
    lines = [[r["name"], r["seq"], f"{r['micro_batch']} x {r['accumulation']}"] + [
        f"{r['phase_ms'][kind][column]:.1f}" if column in r["phase_ms"][kind] else "-"
        for kind in kinds for column in columns] for r in rows]
    device = ("device ms between CUDA events at the same marks; where host ms exceed them the "
              "device waits for the host" if settings.cuda else
              "device ms: not measured, this needs CUDA")
    return [f"One step in phases (per micro-batch: forward, backward away from the boundary; "
            f"the boundary: the last backward with the optimizer step): host ms with no "
            f"synchronisation; {device}.", ""] + table(header, lines)


def op_excess(rows: list) -> list:
    """Where bert-a's and tupe-r's steps have more operators than HF's: the largest excesses
    (profiled rows)."""
    hf = {(r["seq"], r["padding"]): r["op_names"] for r in rows
          if r["model"] == HF and "op_names" in r}
    lines = []
    for r in rows:
        theirs = hf.get((r["seq"], r["padding"]))  # None: HF's row failed or was skipped
        if r["model"].split("/")[0] in ("bert-a", "tupe-r") and "op_names" in r and theirs:
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
    header = ["row", "config", "micro x acc", "ms/step", "samples/s", "ops", "host syncs",
              "device busy ms", "phases of one profiled step: host ms (calls)"]
    lines = []
    for r in electra:
        shape = [r["name"], r["config"], f"{r['micro_batch']} x {r['accumulation']}"]
        if not r.get("fits", True):
            lines.append(shape + [DOES_NOT_FIT] + [""] * (len(header) - 4))
            continue
        lines.append(shape + [
            f"{r['ms_per_step']:.1f}", f"{r['samples_per_s']:.1f}", r.get("ops", "-"),
            r.get("syncs", "-"), f"{r['device_busy_ms']:.1f}" if "device_busy_ms" in r else "-",
            ", ".join(f"{name} {p['host_ms']:.1f} ({p['calls']})"
                      for name, p in r.get("phases", {}).items())])
    return out + table(header, lines)


def sweep_cell(row) -> str:
    if row is None:
        return "-"
    if not row.get("fits", True):
        return DOES_NOT_FIT
    return f"{row['samples_per_s']:.1f} ({row['tflops']:.3g})"


def sweep_lines(settings, sweep: list) -> list:
    micros = settings.sweep_micro_batches
    cells = {(r["zero_stage"], r["micro_batch"]): r for r in sweep}
    best = max(fitting(sweep), key=lambda r: r["samples_per_s"], default=None)
    fastest = ("Fastest: none fit." if best is None else
               f"Fastest: ZeRO stage {best['zero_stage']}, micro-batch {best['micro_batch']} "
               f"({best['samples_per_s']:.1f} samples/s).")
    return [f"ZeRO stage x micro-batch (one model per stage), bert-a at seq {sweep[0]['seq']}, "
            f"{PADDINGS[sweep[0]['padding']]}, global batch {settings.global_batch}: "
            "samples/s (TFLOPS)", ""] + table(
        ["ZeRO stage"] + [f"micro {m}" for m in micros],
        [[stage] + [sweep_cell(cells.get((stage, m))) for m in micros]
         for stage in settings.sweep_zero_stages]) + ["", fastest]


def ours_optimizer(config: dict) -> str:
    params = config["optimizer"].get("params", {})
    if params.get("torch_adam"):
        return f"torch {config['optimizer']['type']}" + (" (fused)" if params.get("fused") else "")
    return f"{config['optimizer']['type']} (DeepSpeed's FusedAdam)"


def compile_text(settings) -> str:
    chosen = model_config(settings, max(settings.seqs), "bert-a", settings.attention[0],
                          settings.compile).compile_mode
    return chosen if settings.compile else f"{chosen} (the device's choice)"


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
        "precision": f"{settings.dtype}; attention {', '.join(settings.attention)}; compile "
                     f"{compile_text(settings)}",
        "micro-batches": f"like for like {settings.micro_batches} (every model); "
                         f"{', '.join(settings.sweep_models) or 'no model'} also x "
                         f"{', '.join(map(str, settings.sweep_factors)) or '-'} on the same "
                         "model, smallest first, until one does not fit; a model's best is its "
                         "fastest",
        "ours": f"{settings.ds_config}, ZeRO stage "
                f"{config.get('zero_optimization', {}).get('stage', 0)}, optimizer "
                f"{ours_optimizer(config)}, gradient clipping "
                f"{config.get('gradient_clipping', 1.0)}",
        "HF": f"BertForMaskedLM sdpa, {hf_precision}, torch AdamW{fused}, same clipping",
        "timing": f"median of {settings.steps} optimizer steps after {settings.warmup} warm-up "
                  "(each micro-batch), one model at a time",
        "peak": f"plain {settings.matmul_n}^3 {settings.dtype if settings.cuda else 'fp32'} "
                f"matmul: {settings.peak_flops / 1e12:.2f} TFLOPS",
    }


def report(settings, result: dict) -> str:
    """The whole report of one run of bench/gpu/step_time.py (`result` as its JSON holds it)."""
    sections = [
        [f"- {key}: {value}" for key, value in result["header"].items()],
        step_table(settings, result["rows"]),
        [f"Verdicts (informational: the exit code is 0 either way; step-time targets at seq "
         f"{target_seq(settings)}):", "", *verdict_table(result["verdicts"])],
        op_excess(result["rows"]), phase_lines(settings, result["rows"]),
        sync_lines(settings, result["rows"] + result["electra"])]
    if result["electra"]:
        sections.append(electra_lines(settings, result["electra"]))
    if result["sweep"]:
        sections.append(sweep_lines(settings, result["sweep"]))
    return "\n\n".join("\n".join(section) for section in sections if section) + "\n"
