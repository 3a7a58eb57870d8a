#!/usr/bin/env bash
# Queue a comparison of positional encodings on Slurm: one array task per (encoding, seed)
# (slurm/compare.sbatch); with --finetune, then one array task per (run, GLUE task)
# (slurm/compare_finetune.sbatch); then `tupe-compare report`. Each stage starts once every task
# of the one before has ended, whatever its result (afterany: a failed run or fine-tune shows as
# failed in the report).
#
#   slurm/submit_compare.sh OUT --data DATA --encodings tupe-r bert-a --model bert-base \
#       --steps 10000 [--seeds 1 2 3] [--objective electra] \
#       [--finetune GLUE_DIR [--tasks rte mrpc] [--finetune-lr 2e-5 3e-5 ...]] [tupe-pretrain flags]
#
# The plan is checked (tupe-pretrain's checks, for --nproc processes per run; the GLUE files) and
# written to OUT/compare.json before anything is queued. Slurm options for the runs go in
# SUBMIT_ARGS (e.g. "--partition gpu --nodes 1 --ntasks-per-node 8 --gpus-per-node 8"), for the
# fine-tunes in FINETUNE_ARGS (default: SUBMIT_ARGS), for the report in REPORT_ARGS; PYTHON
# (default python3) runs the project. Submitting again resumes what is unfinished: finished runs
# and fine-tunes stop at once.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,19p' "$0" >&2
  exit 2
fi
out=$(realpath -m "$1")
shift
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
planned=$("$python" -m tupe_ds.compare.cli plan --out "$out" "$@")
echo "$planned"
count=${planned%% runs planned*}
finetunes=$(sed -n 's/^\([0-9]*\) fine-tunes planned.*/\1/p' <<< "$planned")
export_vars=ALL,TUPE_DS_ROOT="${TUPE_DS_ROOT:-$(dirname "$here")}",PYTHON="$python"
array=$(sbatch --parsable ${SUBMIT_ARGS:-} --array=0-$((count - 1)) --export="$export_vars" \
  "$here/compare.sbatch" "$out")
array=${array%%;*}
last=$array
if [ -n "$finetunes" ]; then
  finetune=$(sbatch --parsable ${FINETUNE_ARGS:-${SUBMIT_ARGS:-}} --array=0-$((finetunes - 1)) \
    --dependency=afterany:"$array" --export="$export_vars" "$here/compare_finetune.sbatch" "$out")
  last=${finetune%%;*}
fi
report=$(sbatch --parsable ${REPORT_ARGS:-} --dependency=afterany:"$last" \
  --job-name=tupe-compare-report --output="$out/report-%j.out" \
  --export=ALL,PYTHON="$python" \
  --wrap="\"$python\" -m tupe_ds.compare.cli report \"$out\"")
stages="runs: job $array (array 0-$((count - 1)))"
[ -z "$finetunes" ] || stages+=", fine-tunes: job $last (array 0-$((finetunes - 1)))"
echo "$stages, report: job ${report%%;*} -> $out/report.md"
