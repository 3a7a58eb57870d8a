# Sourced by the sbatch scripts that train (pretrain.sbatch, compare.sbatch):
#   srun_requeue COMMAND [ARGS ...]
# runs COMMAND as one srun step (a task per GPU). On SIGUSR1 to the batch shell (Slurm's
# --signal=B:USR1@600 before the time limit, or `scancel --batch --signal=USR1`), the tasks get
# it too: tupe-pretrain saves a checkpoint and stops, and then the job requeues itself, to resume
# from that checkpoint. Only a step that ended with 0 is requeued: tupe-pretrain exits 3 when the
# warning came before it trained a single step (the time limit leaves it no time to train: each
# attempt would stop the same way), saying so, and this says the job is not requeued. Returns
# the step's exit status.
# torch builds DeepSpeed's extensions in TORCH_EXTENSIONS_DIR, by default under the home folder,
# which the nodes share: a build on one node then holds a lock the others cannot see. Unless it is
# set, each node builds its own copy on its local disk (sourcing this file sets it).
node_local=${TMPDIR:-/tmp}/tupe_ds-torch-extensions-$(id -u)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$node_local}

# Since Slurm 22.05 srun no longer inherits the job's --cpus-per-task: without it, task/affinity
# and task/cgroup give each task one core for the training loop, the batch-making thread and
# torch's threads. SRUN_CPUS_PER_TASK (srun's variable) passes the job's on, unless already set.
srun_requeue() {
  local requeue= step status=0 port=${MASTER_PORT:-}
  # The rendezvous port, checked free here on the batch host (the step's first node, where rank 0
  # listens) with the sbatch scripts' $python (else $PYTHON, python3): the job id's port
  # (tupe_ds/distributed/launch.py) or the next free one. Each task reads MASTER_PORT from the
  # environment srun passes on; a MASTER_PORT set by the user is kept.
  if [ -z "$port" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    port=$("${python:-${PYTHON:-python3}}" -m tupe_ds.distributed.launchers srun-port) || return
  fi
  if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK="${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}"
  fi
  trap 'requeue=1
        echo "$(date -Is) SIGUSR1: the tasks save a checkpoint and stop; then the job is requeued"
        kill -USR1 "$step" 2>/dev/null || true' USR1  # srun passes it on to every task
  env ${port:+MASTER_PORT=$port} srun --kill-on-bad-exit=1 "$@" &  # env execs srun: $! is srun
  step=$!
  while :; do
    wait "$step" && status=0 || status=$?
    kill -0 "$step" 2>/dev/null || break  # a trapped signal ended the wait, not the step
  done
  trap - USR1
  if [ -n "$requeue" ] && [ "$status" -eq 0 ]; then
    scontrol requeue "$SLURM_JOB_ID"
  elif [ -n "$requeue" ]; then
    echo "$(date -Is) the job is not requeued: its step ended with exit status $status" \
         "(3: it stopped itself, saying why above)" >&2
  fi
  return "$status"
}
