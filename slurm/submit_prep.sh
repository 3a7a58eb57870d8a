#!/usr/bin/env bash
# Queue a sharded data_prep run on Slurm: N array tasks, then the merge once all succeeded.
#
#   slurm/submit_prep.sh N OUT_DIR TOKENIZER INPUT [INPUT ...]
#
# INPUT: files or folders, split into N contiguous groups of files (at least N files).
# TOKENIZER: a tokenizer.json shared by all shards, e.g. from a tupe-prep run on a sample.
# Slurm options (partition, account) go in SBATCH_* variables or SUBMIT_ARGS.
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,9p' "$0" >&2
  exit 2
fi
count=$1 out=$2 tokenizer=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
array=$(sbatch --parsable ${SUBMIT_ARGS:-} --array=0-$((count - 1)) \
  "$here/prep_shard.sbatch" "$out" "$tokenizer" "$@")
array=${array%%;*}
merge=$(sbatch --parsable ${SUBMIT_ARGS:-} --dependency=afterok:"$array" \
  "$here/prep_merge.sbatch" "$out" "$count")
echo "shards: job $array (array 0-$((count - 1))), merge: job ${merge%%;*} -> $out/merged"
