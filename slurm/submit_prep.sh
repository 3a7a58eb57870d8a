#!/usr/bin/env bash
# Queue a sharded data_prep run on Slurm: N array tasks, then the merge once all succeeded; the
# merge removes exact and near duplicates across the shards.
#
#   slurm/submit_prep.sh N OUT_DIR TOKENIZER INPUT [INPUT ...]
#   slurm/submit_prep.sh N OUT_DIR TOKENIZER NAME=INPUT[,INPUT ...] [NAME=INPUT[,INPUT ...] ...]
#
# INPUT: files or folders, split into N contiguous groups of files (at least N files).
# NAME=INPUTS: several sources (corpora), each prepared into OUT_DIR/NAME/{shard*,merged}; each
# source's merge also removes what an earlier source holds (--dedup-against their merged
# folders, once their merges succeeded), so that a blend of them holds each text once.
# TOKENIZER: a tokenizer.json shared by all shards, e.g. from a tupe-prep run on a sample.
# Slurm options (partition, account) go in SBATCH_* variables or SUBMIT_ARGS.
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
count=$1 out=$2 tokenizer=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)

# submit OUT INPUT...: the shard array and the merge of one source; sets $merge (its job id)
submit() {
  local folder=$1 array
  shift
  mkdir -p "$folder"
  array=$(sbatch --parsable ${SUBMIT_ARGS:-} --array=0-$((count - 1)) \
    "$here/prep_shard.sbatch" "$folder" "$tokenizer" "$@")
  array=${array%%;*}
  merge=$(DEDUP_AGAINST="${against:-}" sbatch --parsable ${SUBMIT_ARGS:-} \
    --dependency=afterok:"$array${after:+:$after}" "$here/prep_merge.sbatch" "$folder" "$count")
  merge=${merge%%;*}
  echo "shards: job $array (array 0-$((count - 1))), merge: job $merge -> $folder/merged"
}

if [[ $1 != *=* ]]; then
  submit "$out" "$@"
  exit 0
fi
against= after=
for source in "$@"; do
  if [[ $source != *=* ]]; then
    echo "$source: with several sources, name each: NAME=INPUT[,INPUT ...]" >&2
    exit 2
  fi
  IFS=, read -ra inputs <<< "${source#*=}"
  echo -n "${source%%=*}: "
  submit "$out/${source%%=*}" "${inputs[@]}"
  against="${against:+$against }$out/${source%%=*}/merged" after="${after:+$after:}$merge"
done
