#!/bin/bash
# Fixed-budget SmolLM2 runs (issue 26): same start, data, seed, budget; base block CE vs + Repr-Align vs trajectory.
set -x
cd /work/methods_run
PY=/work/wt/methods/.venv/bin/python
M=/root/.cache/unmask/models/smollm2-135m-a2d
MIN=${MIN:-8}
COMMON="--model $M --data train.jsonl --eval-data heldout.jsonl --eval-every 10 --block-size 4 --batch-size 4 --seq-len 128 --lr 1e-4 --warmup 5 --max-steps 100000 --max-minutes $MIN --lr-schedule cosine_time --save-every 0 --no-progress --seed 1"
export OMP_NUM_THREADS=1
for run in "$@"; do
  case $run in
    base) nice -n 5 /work/wt/methods/.venv/bin/unmask train $COMMON --out out-base --resume ;;
    align) nice -n 5 /work/wt/methods/.venv/bin/unmask train $COMMON --out out-align --align-weight 10 --align-layers all --resume ;;
    traj) nice -n 5 /work/wt/methods/.venv/bin/unmask train $COMMON --out out-traj --objective trajectory --trajectories train.trajectory.jsonl --resume ;;
  esac > log-$run.txt 2>&1
done
