"""tupe_ds.compare.glue: Table 1 from made-up tupe-finetune summaries (TASK.json) — the scores
(the paper's BERT-A row among them) and the held-out learning-rate choice, the paired t intervals
over pretraining seeds against a direct numpy computation, the bootstrap over fine-tuning seeds
against a loop-by-loop one, Welch's t against scipy's, the coverage of the intervals by
simulation, and the sentences and markdown made from them."""

import statistics

import numpy as np
import pytest
import scipy.stats

from tupe_ds.compare import glue, glue_intervals, glue_markdown
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
        assert found[name]["method"] == (f"paired t over {pretraining_seeds} pretraining seeds "
                                         "(pretraining and fine-tuning noise)")
        assert found[name]["contains_zero"] == (d.mean() - half <= 0 <= d.mean() + half)


def bootstrap_by_hand(encoding, baseline, resamples):
    """{column: (point difference, [2.5%, 97.5%] quantiles)} resample by resample."""
    rng = np.random.default_rng(glue_intervals.BOOTSTRAP_SEED)
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
        assert found["method"] == ("bootstrap over 5 fine-tuning seeds of one pretraining seed "
                                   "(fine-tuning noise only)")
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
        assert "contains 0" in glue_markdown.describe(same)
    row = next(line for line in glue_markdown.markdown(made)
               if line.startswith("| tupe |") and "[" in line)
    assert row.count("contains 0") == 4


def test_one_fine_tuning_seed_gives_no_interval():
    rng = np.random.default_rng(5)
    tasks = ["mnli", "rte"]
    made = one_seed_each(made_up(rng, tasks), made_up(rng, tasks), tasks)
    assert all(found is None for found in made["differences"]["tupe"].values())
    assert "no interval" in glue_markdown.headline(made)
    rows = [line for line in glue_markdown.markdown(made) if line.startswith("| tupe |")]
    assert rows[-1] == "| tupe | - | - | - | - |"


def test_headline_names_the_average_difference_and_its_interval():
    rng = np.random.default_rng(6)
    tasks = ["mnli", "rte"]
    made = one_seed_each(made_up(rng, tasks, seeds=5, shift=0.05), made_up(rng, tasks, seeds=5),
                         tasks)
    average = made["differences"]["tupe"]["average"]
    sentence = glue_markdown.headline(made)
    assert sentence.startswith("GLUE average minus bert-a's:")
    assert "tupe" in sentence and f"{average['difference']:+.2f}" in sentence
    assert f"{average['low']:+.2f}" in sentence and f"{average['high']:+.2f}" in sentence
    assert "bootstrap over 5 fine-tuning seeds of one pretraining seed" in sentence


def test_one_fine_tuning_seed_on_either_side_gives_no_interval():
    """The seed count is the fewer of the two sides' (it was the baseline's alone)."""
    rng = np.random.default_rng(7)
    tasks = ["rte"]
    one, three = made_up(rng, tasks, seeds=1), made_up(rng, tasks, seeds=3)
    for encoding, baseline in ((one, three), (three, one)):
        made = one_seed_each(encoding, baseline, tasks)
        assert made["differences"]["tupe"] == {"rte": None, "average": None}
    five = made_up(rng, tasks, seeds=5)
    found = one_seed_each(three, five, tasks)["differences"]["tupe"]["rte"]
    assert found["method"] == ("Welch t over 3 to 5 fine-tuning seeds of one pretraining seed "
                               "(fine-tuning noise only)")


def test_welch_interval_below_five_fine_tuning_seeds_matches_scipy():
    rng = np.random.default_rng(8)
    tasks = ["mnli", "rte"]
    encoding = made_up(rng, tasks, lrs=(1e-5, 2e-5), seeds=3)
    baseline = made_up(rng, tasks, lrs=(1e-5, 2e-5, 3e-5), seeds=4)
    found = one_seed_each(encoding, baseline, tasks)["differences"]["tupe"]
    point = {c: column_scores(encoding)[c] - column_scores(baseline)[c] for c in found}

    def chosen(summaries, task, dev_set):  # per seed, at the task's best learning rate
        s = summaries[task]
        return [100 * v[dev_set][s["metric"]] for v in s["configurations"][s["best"]]["seeds"]
                .values()]

    for task, dev_set, name in [("mnli", "m", "mnli-m"), ("mnli", "mm", "mnli-mm"),
                                ("rte", "dev", "rte")]:
        x, y = chosen(encoding, task, dev_set), chosen(baseline, task, dev_set)
        low, high = scipy.stats.ttest_ind(x, y, equal_var=False).confidence_interval(0.95)
        half = (high - low) / 2  # scipy's is around the difference of means, ours the scores'
        assert found[name]["difference"] == pytest.approx(point[name])
        assert [found[name]["low"], found[name]["high"]] == pytest.approx(
            [point[name] - half, point[name] + half])
        assert found[name]["method"].startswith("Welch t over 3 to 4 fine-tuning seeds")
        assert found[name]["low"] > point[name] - 3 * half  # an interval, not the whole line
    assert found["average"]["difference"] == pytest.approx(point["average"])
    assert found["average"]["low"] < point["average"] < found["average"]["high"]


def simulated(rng, tasks, seeds, lrs, shift, noise=0.02):
    """{task: TASK.json} of fine-tunes scoring 0.80 + shift + N(0, noise) a seed, each learning
    rate 0.01 below the one before (so the choice matters, as in a real grid)."""
    return {task: summary(task, {1e-5 * (i + 1): (
        0.80 - 0.01 * i + shift + rng.normal(0, noise, (seeds, len(dev_sets(task))))).tolist()
        for i in range(lrs)}) for task in tasks}


def coverage(seeds, lrs, shift, trials, rng, noise=0.02):
    """{column: share of the trials whose 95% interval holds the true difference (100 x shift)}
    between an encoding (shift, noise) and a baseline (0, 0.02)."""
    tasks, held = ["rte", "mrpc"], {"rte": 0, "average": 0}
    for _ in range(trials):
        made = one_seed_each(simulated(rng, tasks, seeds, lrs, shift, noise),
                             simulated(rng, tasks, seeds, lrs, 0.0), tasks)
        for name in held:
            found = made["differences"]["tupe"][name]
            held[name] += found["low"] - 1e-9 <= 100 * shift <= found["high"] + 1e-9
    return {name: count / trials for name, count in held.items()}


# 95% less 2.5 points (600 trials' standard error is 0.9), and conservative up to 99.7%: the
# bootstrap's learning-rate choice in every resample widens it (5x4's average: 99.2% in 1,500)
COVERAGE_BAND = (0.925, 0.997)


@pytest.mark.parametrize("seeds, lrs", [(2, 2), (3, 2), (5, 4)])  # 3x2: make compare's grid
@pytest.mark.parametrize("shift, noise", [(0.0, 0.02), (0.03, 0.03)])
def test_intervals_cover_the_true_difference_95_percent_of_the_time(seeds, lrs, shift, noise):
    """No difference, and 3 points with noisier fine-tunes; 5x4: tupe-finetune's default grid
    (the paper's)."""
    rng = np.random.default_rng([seeds, lrs, int(100 * shift)])
    found = coverage(seeds, lrs, shift, 600, rng, noise)
    assert all(COVERAGE_BAND[0] <= value <= COVERAGE_BAND[1] for value in found.values()), found


def test_coverage_check_fails_for_a_bootstrap_of_three_seeds(monkeypatch):
    """The simulation can fail: the bootstrap this replaced below 5 seeds covers about 90%."""
    monkeypatch.setattr(glue_intervals, "BOOTSTRAP_SEEDS", 2)
    found = coverage(3, 2, 0.0, 600, np.random.default_rng(32))
    assert found["rte"] < COVERAGE_BAND[0], found


def test_a_clear_difference_is_found_with_three_seeds():
    rng = np.random.default_rng(9)
    excluded = [one_seed_each(simulated(rng, ["rte"], 3, 2, 0.10),
                              simulated(rng, ["rte"], 3, 2, 0.0), ["rte"])
                ["differences"]["tupe"]["rte"]["low"] > 0 for _ in range(200)]
    assert np.mean(excluded) > 0.95  # 10 points against a seed's 2 points of noise: 97%


def test_held_out_learning_rate_choice():
    """Seeds 1 3 5 (one half) favour lr 1e-5, seeds 2 4 (the other) 2e-5: each half's choice is
    scored on the other half, and the paper's choice (all seeds) is higher."""
    rte = summary("rte", {1e-5: [[0.9], [0.5], [0.9], [0.5], [0.9]],
                          2e-5: [[0.6], [0.8], [0.6], [0.8], [0.6]]})
    assert rte["best"] == "lr=1e-05" and rte["best_median"]["dev"]["accuracy"] == 0.9
    # chosen on 1 3 5: 1e-5, scored on 2 4: 0.5; chosen on 2 4: 2e-5, scored on 1 3 5: 0.6
    made = glue.table({"x": {1: {"rte": rte}}}, "x", ["rte"])
    assert made["held_out"]["x"]["rte"]["mean"] == pytest.approx(55)
    assert made["scores"]["x"]["rte"]["mean"] == pytest.approx(90)
    lines = glue_markdown.markdown(made)
    assert "| x, lr held out | 55.00 | 55.00 |" in lines
    assert any("favours every score" in line for line in lines)
    one = summary("rte", {1e-5: [[0.9]]})
    assert glue.table({"x": {1: {"rte": one}}}, "x", ["rte"])["held_out"]["x"]["rte"]["mean"] \
        is None
