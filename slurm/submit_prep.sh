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
# folders, once their merges succeeded), so that a blend of them holds each text once. NAME:
# letters, digits, '.', '_', '-', each once (an input path whose first '=' comes before any '/'
# reads as NAME=INPUT: write it ./PATH). Names, inputs and TOKENIZER are checked before anything
# is queued.
# TOKENIZER: a tokenizer.json shared by all shards, e.g. from a tupe-prep run on a sample.
# Read here and passed to the jobs as arguments, with the paths made absolute (the jobs need
# nothing from this shell's environment, so SUBMIT_ARGS may hold --export=NONE): SUBMIT_ARGS,
# sbatch options (partition, account); TUPE_PREP_ARGS, extra tupe-prep options of the shards
# (e.g. "--lowercase"); PYTHON (default python3), the interpreter that has tupe_ds installed.
# Printed per source: the job ids, and the commands that re-run one failed shard K alone and
# then the merge (a failed shard leaves the merge pending, never to run: scancel it first).
set -euo pipefail
if [ $# -lt 4 ]; then
  sed -n '2,21p' "$0" >&2
  exit 2
fi
count=$1
shift
if ! [[ $count =~ ^[1-9][0-9]{0,5}$ ]]; then
  echo "N: the number of shards, a whole number from 1 to 999999, not '$count'" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
absolute() { [[ $1 == /* ]] && echo "$1" || echo "$PWD/$1"; }
out=$(absolute "$1") tokenizer=$(absolute "$2")
shift 2
if ! python=$(command -v "${PYTHON:-python3}"); then
  echo "PYTHON: no '${PYTHON:-python3}' here; set PYTHON to the interpreter that has tupe_ds" >&2
  exit 2
fi
python=$(absolute "$python")
if ! "$python" -c "import data_prep" 2>/dev/null; then
  echo "PYTHON: $python cannot import data_prep; set PYTHON to the interpreter that has tupe_ds" >&2
  exit 2
fi
read -ra submit_args <<< "${SUBMIT_ARGS:-}"
read -ra prep_args <<< "${TUPE_PREP_ARGS:-}"
quoted() { local line; line=$(printf '%q ' "$@"); echo "${line% }"; }  # as a shell reads it

# submit FOLDER INPUT...: the shard array and the merge of one source (the merge de-duplicated
# against the folders in $against, after the jobs in $after); sets $merge (its job id)
submit() {
  local folder=$1 array inputs=() input
  shift
  for input in "$@"; do inputs+=("$(absolute "$input")"); done
  local shard=("$here/prep_shard.sbatch" --count "$count" --python "$python" "$folder"
               "$tokenizer" "${inputs[@]}" ${prep_args[@]+-- "${prep_args[@]}"})
  local merging=("$here/prep_merge.sbatch" --count "$count" --python "$python" "$folder"
                 ${against[@]+--dedup-against "${against[@]}"})
  mkdir -p "$folder"
  array=$(sbatch --parsable "${submit_args[@]}" --array=0-$((count - 1)) "${shard[@]}")
  array=${array%%;*}
  merge=$(sbatch --parsable "${submit_args[@]}" --dependency=afterok:"$array${after:+:$after}" \
    "${merging[@]}")
  merge=${merge%%;*}
  echo "shards: job $array (array 0-$((count - 1))), merge: job $merge -> $folder/merged"
  echo "  re-run shard K alone: $(quoted sbatch "${submit_args[@]}" --array=K "${shard[@]}")"
  echo "  then the merge: $(quoted sbatch "${submit_args[@]}" "${merging[@]}")"
}

# Everything is checked before anything is queued. A source is named when the text before its
# first "=" holds no "/" (as tupe-pretrain's --data reads NAME=FOLDER): an input path such as
# data/lang=en/a.txt is an input.
named() { [[ $1 == *=* && ${1%%=*} != */* ]]; }
fail() { echo "$1" >&2; exit 2; }
[ -f "$tokenizer" ] || fail "TOKENIZER: $tokenizer is not a file"
names=() sources=()
if named "$1"; then
  for source in "$@"; do
    named "$source" || fail "$source: with several sources, name each: NAME=INPUT[,INPUT ...]"
    name=${source%%=*}
    [[ $name =~ ^[A-Za-z0-9_][A-Za-z0-9._-]*$ && $name != *..* ]] || fail "$source: the \
source's name '$name' must be letters, digits, '.', '_' or '-' (it names OUT_DIR/$name and the \
blend's metrics)"
    for seen in ${names[@]+"${names[@]}"}; do
      [ "$seen" != "$name" ] || fail "$source: the name '$name' is given twice; give each source \
once, its inputs separated by commas"
    done
    [ -n "${source#*=}" ] || fail "$source: no INPUT after '$name='"
    names+=("$name") sources+=("${source#*=}")
  done
else
  for input in "$@"; do
    [ -e "$input" ] || fail "INPUT: $input does not exist"
  done
  submit "$out" "$@"
  exit 0
fi
for i in "${!names[@]}"; do
  IFS=, read -ra listed <<< "${sources[$i]}"
  for input in "${listed[@]}"; do
    [ -e "$input" ] || fail "INPUT: $input of source ${names[$i]} does not exist (an input path \
whose first '=' comes before any '/' reads as NAME=INPUT: write it ./${names[$i]}=...)"
  done
done

against=() after=
for i in "${!names[@]}"; do
  IFS=, read -ra inputs <<< "${sources[$i]}"
  echo -n "${names[$i]}: "
  submit "$out/${names[$i]}" "${inputs[@]}"
  against+=("$out/${names[$i]}/merged") after="${after:+$after:}$merge"
done
