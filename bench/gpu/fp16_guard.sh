#!/usr/bin/env bash
# fp16 and bf16 on one GPU, through tupe-pretrain and tests/support/fault_worker.py: the non-finite guard
# on DeepSpeed's real fp16 optimizers (ZeRO-2's DynamicLossScaler, stage 0's FP16_UnfusedOptimizer)
# and resumes of their checkpoints under weights-only loads. Tiny model, 1 process, about 3 min.
#   bash bench/gpu/fp16_guard.sh DATA   (DATA: a tupe-prep folder; on the GPU machine after
#                                        `source .whl/setup.sh`; the figures: bench/README.md)
# NaN losses at steps 5-8 while the loss scale is above its minimum are the scaler's search: not
# counted, the run ends (exit 0) and resumes; with the minimum at 32768 they count, and 3 in a row
# stop the run (exit 3); bf16 counts every one. Each run prints the loss scale by step and the
# count of steps not applied.
set -u
D=${1:?usage: bench/gpu/fp16_guard.sh DATA}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} TUPE_DS_WAIT_NOTICE=600
work=$(mktemp -d)
python3 - "$work" <<'PY'
import json, sys
base = json.load(open("ds_configs/cpu_zero2.json"))
base["optimizer"]["params"]["torch_adam"] = True
def write(name, **extra):
    config = json.loads(json.dumps(base)); config.update(extra)
    json.dump(config, open(f"{sys.argv[1]}/{name}.json", "w"))
write("fp16", fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 16})
write("fp16min", fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                       "min_loss_scale": 32768})
write("bf16", bf16={"enabled": True})
PY
run() {  # NAME CONFIG ZERO FAULT FLAGS...
  name=$1 config=$2 zero=$3 fault=$4; shift 4
  echo "=== $name (config $config, ZeRO $zero, fault '$fault', $*)"
  TUPE_DS_FAULT=$fault timeout 240 python3 -m torch.distributed.run --nproc_per_node 1 \
    --master_port ${MASTER_PORT:-$((20000 + RANDOM % 10000))} tests/support/fault_worker.py pretrain --data $D \
    --model tiny --seq-len 64 --log-interval 1 --eval-samples 32 --dropout 0 --lr 2e-3 \
    --warmup-steps 2 --save-interval 10 --eval-interval 100 --ds-config $work/$config.json \
    --zero-stage $zero --out $work/runs/$name "$@" > $work/$name.log 2>&1
  echo "exit $?"
  grep -E "tupe-pretrain|resumed at|starting step|stopping|exit code|final valid|Error|error" $work/$name.log | grep -v "waiting" | cut -c1-400 | head -20
  python3 - "$work/runs/$name" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/train_log.jsonl")]
print("loss scale by step:", [(r["step"], r.get("train/loss_scale")) for r in rows if "train/loss" in r][:14])
print("nonfinite:", [(r["step"], r["train/nonfinite_steps"]) for r in rows if r.get("train/nonfinite_steps")][-3:])
PY
}
nvidia-smi --query-gpu=name --format=csv,noheader
# the scaler's search for its scale (4 NaN losses while the scale is above its minimum) is not counted
run zero2-fp16 fp16 2 "nan-loss:0:5,6,7,8" --steps 20
run zero2-fp16 fp16 2 "" --steps 24           # resumes an fp16 ZeRO-2 checkpoint, weights-only loads
run stage0-fp16 fp16 0 "nan-loss:0:5,6,7,8" --steps 20
run stage0-fp16 fp16 0 "" --steps 24           # FP16_UnfusedOptimizer's checkpoint
# at its minimum every skip counts: 3 in a row stop the run (exit 3)
run zero2-fp16-min fp16min 2 "nan-loss:0:5,6,7,8,9,10" --steps 20
run stage0-fp16-min fp16min 0 "nan-loss:0:5,6,7,8,9,10" --steps 20
run zero2-bf16 bf16 2 "nan-loss:0:5" --steps 12
run zero2-bf16 bf16 2 "" --steps 14
