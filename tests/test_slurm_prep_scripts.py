"""slurm/submit_prep.sh and its two sbatch scripts, run through a stand-in `sbatch` that executes
jobs at once (array tasks one by one, with the SLURM_ARRAY_* variables Slurm sets)."""

import os
import random
import stat
import subprocess
import sys

from megatron.core.datasets.indexed_dataset import IndexedDataset

from test_data_prep import run, unique_document, write_txt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_SBATCH = """#!/usr/bin/env bash
array=""
while [[ $1 == --* ]]; do
  case $1 in --array=*) array=${1#--array=} ;; esac
  shift
done
script=$1; shift
if [ -n "$array" ]; then
  lo=${array%-*} hi=${array#*-}
  for ((i = lo; i <= hi; i++)); do
    SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_TASK_MIN=$lo SLURM_ARRAY_TASK_COUNT=$((hi - lo + 1)) \\
      bash "$script" "$@" >&2 || exit 1
  done
else
  bash "$script" "$@" >&2 || exit 1
fi
echo 4242
"""


def test_submit_prep_runs_shards_then_merge(tmp_path):
    rng = random.Random(5)
    files = [write_txt(tmp_path / f"part{i}.txt", [unique_document(rng) for _ in range(6)])
             for i in range(3)]
    run(files, tmp_path / "tok", dedup="exact")
    tokenizer = str(tmp_path / "tok" / "tokenizer.json")
    single = run(files, tmp_path / "single", dedup="exact", valid_fraction=0.01, tokenizer=tokenizer)

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": ROOT, "TUPE_PREP": f"{sys.executable} -m data_prep",
           "TUPE_PREP_ARGS": "--dedup exact --workers 1"}
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm", "submit_prep.sh"), "2",
                             str(tmp_path / "out"), tokenizer, *files],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "merge: job 4242" in result.stdout
    merged = IndexedDataset(str(tmp_path / "out" / "merged" / "train"))
    one = IndexedDataset(str(tmp_path / "single" / "train"))
    assert (merged.sequence_lengths == one.sequence_lengths).all()
    assert all((merged[i] == one[i]).all() for i in range(len(one)))
    assert single["documents_out"] == 18


def test_shard_script_explains_its_usage(tmp_path):
    result = subprocess.run(["bash", os.path.join(ROOT, "slurm", "prep_shard.sbatch")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "usage: sbatch --array" in result.stderr
