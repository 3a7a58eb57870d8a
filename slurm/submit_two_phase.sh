#!/usr/bin/env bash
# BERT's two-phase recipe on Slurm: phase 1 at seq 128 (RUN_DIR/phase1), then phase 2 at seq 512
# (RUN_DIR/phase2) started from phase 1's last checkpoint with --init-from: its weights, a new
# schedule and data stream (as NVIDIA's and DeepSpeed's BERT examples train). Phase 2 is queued
# with --dependency=afterok: it starts only once phase 1 has finished every step (a preempted
# phase 1 requeues itself and keeps phase 2 waiting); a failed phase 1 leaves it never to run
# (`scancel` it, fix, and submit again: finished work is not redone).
#
#   slurm/submit_two_phase.sh DATA RUN_DIR [tupe-pretrain flags for both phases ...]
#
# The flags given go to both phases; the sequence length and steps of each come from:
# PHASE1_STEPS (default 900000) at PHASE1_SEQ_LEN (128), PHASE2_STEPS (100000) at PHASE2_SEQ_LEN
# (512): the BERT paper's 90% / 10%. PRESET (bert-large) is slurm/pretrain.sbatch's preset;
# SUBMIT_ARGS holds the sbatch options of both jobs (e.g. "--nodes 4 --partition gpu"); PYTHON
# and TUPE_DS_ROOT as for slurm/pretrain.sbatch.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,19p' "$0" >&2
  exit 2
fi
data=$1 run_dir=$(realpath -m "$2")
shift 2
here=$(cd "$(dirname "$0")" && pwd)
phase1=$(sbatch --parsable ${SUBMIT_ARGS:-} --job-name=tupe-phase1 \
  "$here/pretrain.sbatch" "${PRESET:-bert-large}" "$data" "$run_dir/phase1" "$@" \
  --seq-len "${PHASE1_SEQ_LEN:-128}" --steps "${PHASE1_STEPS:-900000}")
phase1=${phase1%%;*}
phase2=$(sbatch --parsable ${SUBMIT_ARGS:-} --job-name=tupe-phase2 \
  --dependency=afterok:"$phase1" \
  "$here/pretrain.sbatch" "${PRESET:-bert-large}" "$data" "$run_dir/phase2" "$@" \
  --seq-len "${PHASE2_SEQ_LEN:-512}" --steps "${PHASE2_STEPS:-100000}" \
  --init-from "$run_dir/phase1")
echo "phase 1: job $phase1 -> $run_dir/phase1; phase 2: job ${phase2%%;*} -> $run_dir/phase2 (after phase 1 succeeds)"
