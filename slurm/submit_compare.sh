#!/usr/bin/env bash
# Queue a comparison of positional encodings on Slurm: one array task per (encoding, seed)
# (slurm/compare.sbatch), then `tupe-compare report` once every task has ended, whatever its
# result (afterany: a failed run shows as failed in the report).
#
#   slurm/submit_compare.sh OUT --data DATA --encodings tupe-r,bert-a --model bert-base \
#       --steps 10000 [--seeds 1,2,3] [--objective electra] [tupe-pretrain flags ...]
#
# The plan is checked (tupe-pretrain's checks, for --nproc processes per run) and written to
# OUT/compare.json before anything is queued. Slurm options for the runs go in SUBMIT_ARGS (e.g.
# "--partition gpu --nodes 1 --ntasks-per-node 8 --gpus-per-node 8"), for the report in
# REPORT_ARGS; PYTHON (default python3) runs the project. Submitting again resumes what is
# unfinished: finished runs stop at once.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
out=$(realpath -m "$1")
shift
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
planned=$("$python" -m tupe_ds.compare.cli plan --out "$out" "$@")
echo "$planned"
count=${planned%% runs planned*}
array=$(sbatch --parsable ${SUBMIT_ARGS:-} --array=0-$((count - 1)) \
  --export=ALL,TUPE_DS_ROOT="${TUPE_DS_ROOT:-$(dirname "$here")}",PYTHON="$python" \
  "$here/compare.sbatch" "$out")
array=${array%%;*}
report=$(sbatch --parsable ${REPORT_ARGS:-} --dependency=afterany:"$array" \
  --job-name=tupe-compare-report --output="$out/report-%j.out" \
  --export=ALL,PYTHON="$python" \
  --wrap="\"$python\" -m tupe_ds.compare.cli report \"$out\"")
echo "runs: job $array (array 0-$((count - 1))), report: job ${report%%;*} -> $out/report.md"
