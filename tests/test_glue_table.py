"""tupe_ds.compare.glue: Table 1 from made-up tupe-finetune summaries (TASK.json) — the scores
(the paper's BERT-A row among them), the paired t intervals over pretraining seeds against a
direct numpy computation, the bootstrap over fine-tuning seeds against a loop-by-loop one, and
the sentences and markdown made from them."""

import statistics

import numpy as np
import pytest

from tupe_ds.compare import glue
from tupe_ds.finetune.tasks import TASKS

T_975 = {2: 12.706204736174707, 3: 4.302652729911275}  # Student t 0.975 quantile by seed count
BERT_A = {"mnli": (84.93, 84.91), "qnli": (91.34,), "qqp": (91.04,), "sst2": (92.88,),
          "cola": (55.19,), "mrpc": (88.29,), "rte": (68.61,), "stsb": (89.43,)}


def dev_sets(task):
    return [name for name, _ in TASKS[task].glue_dev]


def summary(task, values, seeds=None):
    """TASK.json of `task` from {lr: [[value per dev set] per fine-tuning seed]}."""
    metric, sets = TASKS[task].metrics[0], dev_sets(task)
    configurations = {}
    for lr, rows in values.items():
        names = [str(s) for s in (seeds or range(1, len(rows) + 1))]
        configurations[f"lr={lr:g}"] = {
            "lr": lr,
            "seeds": {n: {s: {metric: v} for s, v in zip(sets, row)}
                      for n, row in zip(names, rows)},
            "median": {s: {metric: statistics.median(row[i] for row in rows)}
                       for i, s in enumerate(sets)}}
    best = max(configurations, key=lambda c: configurations[c]["median"][sets[0]][metric])
    return {"task": task, "metric": metric, "configurations": configurations, "best": best,
            "best_median": configurations[best]["median"]}


def made_up(rng, tasks, lrs=(2e-5,), seeds=1, shift=0.0, width=0.3):
    """{task: summary} with random values in [0.6, 0.6 + width), plus shift."""
    def values(task):
        return (rng.uniform(0.6, 0.6 + width, (seeds, len(dev_sets(task)))) + shift).tolist()
    return {task: summary(task, {lr: values(task) for lr in lrs}) for task in tasks}


def column_scores(summaries):
    """{column: 100 * best median}, and the average over the columns."""
    found = {}
    for task, s in summaries.items():
        for name, values in s["best_median"].items():
            column = task if len(s["best_median"]) == 1 else f"{task}-{name}"
            found[column] = 100 * values[s["metric"]]
    return {**found, "average": float(np.mean(list(found.values())))}


def test_scores_are_best_medians_and_the_paper_bert_a_row():
    bert_a = {task: summary(task, {1e-5: [[v / 100 for v in values]]})
              for task, values in BERT_A.items()}
    made = glue.table({"bert-a": {1: bert_a}}, "bert-a", list(BERT_A), resamples=2000)
    cells = made["scores"]["bert-a"]
    assert made["columns"] == ["mnli-m", "mnli-mm", "qnli", "qqp", "sst2", "cola", "mrpc", "rte",
                               "stsb", "average"]
    assert cells["mnli-m"]["mean"] == pytest.approx(84.93)
    assert cells["mnli-mm"]["mean"] == pytest.approx(84.91)
    assert cells["stsb"]["mean"] == pytest.approx(89.43)
    assert round(cells["average"]["mean"], 2) == 82.96
    assert cells["average"]["sd"] is None and made["differences"] == {}
    # the first dev set picks the learning rate: mm's 0.90 is not the score
    mnli = summary("mnli", {2e-5: [[0.80, 0.70]] * 3, 3e-5: [[0.79, 0.90]] * 3})
    rte = summary("rte", {2e-5: [[0.6], [0.7], [0.8]], 3e-5: [[0.9], [0.5], [0.6]]})
    cells = glue.table({"x": {1: {"mnli": mnli, "rte": rte}}}, "x", ["mnli", "rte"])["scores"]["x"]
    assert [cells[c]["mean"] for c in ("mnli-m", "mnli-mm", "rte")] == pytest.approx([80, 70, 70])
    assert cells["average"]["mean"] == pytest.approx(220 / 3)


def test_scores_over_several_pretraining_seeds():
    rng = np.random.default_rng(1)
    tasks = ["mnli", "cola", "rte"]
    runs = {seed: made_up(rng, tasks, lrs=(1e-5, 2e-5), seeds=3) for seed in (1, 2, 3, 4)}
    cells = glue.table({"tupe": runs}, "tupe", tasks)["scores"]["tupe"]
    per_seed = {seed: column_scores(s) for seed, s in runs.items()}
    for name in ["mnli-m", "mnli-mm", "cola", "rte", "average"]:
        found = [per_seed[seed][name] for seed in runs]
        assert cells[name]["mean"] == pytest.approx(np.mean(found))
        assert cells[name]["sd"] == pytest.approx(np.std(found, ddof=1))


@pytest.mark.parametrize("pretraining_seeds", [2, 3])
def test_paired_differences_over_pretraining_seeds(pretraining_seeds):
    rng = np.random.default_rng(2)
    tasks = ["mnli", "rte", "sst2"]
    seeds = range(1, pretraining_seeds + 1)
    finetunes = {name: {seed: made_up(rng, tasks, lrs=(1e-5, 3e-5), seeds=3) for seed in seeds}
                 for name in ("tupe", "bert-a")}
    found = glue.table(finetunes, "bert-a", tasks)["differences"]["tupe"]
    for name in ["mnli-m", "mnli-mm", "rte", "sst2", "average"]:
        d = np.array([column_scores(finetunes["tupe"][s])[name]
                      - column_scores(finetunes["bert-a"][s])[name] for s in seeds])
        half = T_975[pretraining_seeds] * np.std(d, ddof=1) / np.sqrt(pretraining_seeds)
        assert found[name]["difference"] == pytest.approx(d.mean())
        assert [found[name]["low"], found[name]["high"]] == pytest.approx(
            [d.mean() - half, d.mean() + half])
        assert f"paired over {pretraining_seeds} pretraining seeds" in found[name]["method"]
        assert found[name]["contains_zero"] == (d.mean() - half <= 0 <= d.mean() + half)


def bootstrap_by_hand(encoding, baseline, resamples):
    """{column: (point difference, [2.5%, 97.5%] quantiles)} resample by resample."""
    rng = np.random.default_rng(glue.BOOTSTRAP_SEED)
    drawn = []
    for summaries in (encoding, baseline):
        side = {}
        for task in sorted(summaries):
            s, sets = summaries[task], dev_sets(task)
            configurations = list(s["configurations"].values())
            seeds = sorted(configurations[0]["seeds"], key=int)
            picks = rng.integers(0, len(seeds), size=(resamples, len(seeds)))
            for b in range(resamples):
                def median(configuration, dev_set):
                    return np.median([100 * configuration["seeds"][seeds[i]][dev_set][s["metric"]]
                                      for i in picks[b]])
                best = configurations[int(np.argmax([median(c, sets[0]) for c in configurations]))]
                for name in sets:
                    column = task if len(sets) == 1 else f"{task}-{name}"
                    side.setdefault(column, []).append(median(best, name))
        drawn.append(side)
    diffs = {c: [e - b for e, b in zip(drawn[0][c], drawn[1][c])] for c in drawn[0]}
    diffs["average"] = [sum(d[b] for d in diffs.values()) / len(diffs) for b in range(resamples)]
    point = {c: column_scores(encoding)[c] - column_scores(baseline)[c] for c in diffs}
    return {c: (point[c], np.quantile(diffs[c], [0.025, 0.975])) for c in diffs}


def one_seed_each(encoding, baseline, tasks):
    return glue.table({"tupe": {7: encoding}, "bert-a": {7: baseline}}, "bert-a", tasks,
                      resamples=2000)


def test_bootstrap_over_fine_tuning_seeds_matches_a_loop_by_loop_one():
    rng = np.random.default_rng(3)
    seeds = (3, 10, 1, 7, 22)  # by int: 1 3 7 10 22; as strings "1" "10" "22" "3" "7"
    def summaries(tasks, lrs):  # tasks not in sorted order: the bootstrap sorts them
        return {task: summary(task, {lr: rng.uniform(0.6, 0.9, (5, len(dev_sets(task)))).tolist()
                                     for lr in lrs}, seeds) for task in tasks}
    encoding = summaries(("rte", "mnli"), (1e-5, 2e-5, 3e-5))
    baseline = summaries(("mnli", "rte"), (1e-5, 2e-5))
    made = one_seed_each(encoding, baseline, ["mnli", "rte"])
    expected = bootstrap_by_hand(encoding, baseline, 2000)
    assert set(expected) == {"mnli-m", "mnli-mm", "rte", "average"}
    for name, (difference, (low, high)) in expected.items():
        found = made["differences"]["tupe"][name]
        assert found["difference"] == pytest.approx(difference)
        assert [found["low"], found["high"]] == pytest.approx([low, high])
        assert found["method"] == "bootstrap over 5 fine-tuning seeds"
        assert found["contains_zero"] == (low <= 0 <= high)


def test_bootstrap_sees_a_large_shift_and_no_difference():
    tasks = ["mnli", "rte"]
    quiet = dict(tasks=tasks, lrs=(1e-5, 2e-5), seeds=5, width=0.04)  # 4 points of noise
    baseline = made_up(np.random.default_rng(4), **quiet)
    shifted = made_up(np.random.default_rng(4), **quiet, shift=0.10)
    found = one_seed_each(shifted, baseline, tasks)["differences"]["tupe"]
    for name in ["mnli-m", "mnli-mm", "rte", "average"]:
        assert found[name]["difference"] == pytest.approx(10)
        assert found[name]["low"] > 0 and not found[name]["contains_zero"]
    made = one_seed_each(baseline, baseline, tasks)
    for name, same in made["differences"]["tupe"].items():
        assert same["difference"] == 0 and same["low"] < 0 < same["high"] and same["contains_zero"]
        assert "contains 0" in glue.describe(same)
    row = next(line for line in glue.markdown(made) if line.startswith("| tupe |") and "[" in line)
    assert row.count("contains 0") == 4


def test_one_fine_tuning_seed_gives_no_interval():
    rng = np.random.default_rng(5)
    tasks = ["mnli", "rte"]
    made = one_seed_each(made_up(rng, tasks), made_up(rng, tasks), tasks)
    assert all(found is None for found in made["differences"]["tupe"].values())
    assert "no interval" in glue.headline(made)
    rows = [line for line in glue.markdown(made) if line.startswith("| tupe |")]
    assert rows[-1] == "| tupe | - | - | - | - |"


def test_headline_names_the_average_difference_and_its_interval():
    rng = np.random.default_rng(6)
    tasks = ["mnli", "rte"]
    made = one_seed_each(made_up(rng, tasks, seeds=5, shift=0.05), made_up(rng, tasks, seeds=5),
                         tasks)
    average = made["differences"]["tupe"]["average"]
    sentence = glue.headline(made)
    assert sentence.startswith("GLUE average minus bert-a's:")
    assert "tupe" in sentence and f"{average['difference']:+.2f}" in sentence
    assert f"{average['low']:+.2f}" in sentence and f"{average['high']:+.2f}" in sentence
    assert "bootstrap over 5 fine-tuning seeds" in sentence
