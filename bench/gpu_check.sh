#!/usr/bin/env bash
# The GPU paths, checked on a lent GPU machine (bench/RESULTS_gpu.md says what it printed): torch on CUDA, the
# serverless backend's instances on their GPUs (tests/gpu), a GRPO run on CUDA (local backend), DeepSpeed ZeRO-2
# with NCCL. The machine has torch and transformers but no Ray, Lark or DeepSpeed: they come as wheels in .whl/
# (Ray, too large as a wheel, as an xz tarball of its package without Java, RLlib, Serve, Tune and Train).
# Usage: bash bench/gpu_check.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PY:-python3}
SITE=/tmp/site
if [ -d .whl ] && ! $PY -c "import ray, lark" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl || exit 1
    tar xJf .whl/ray.tar.xz -C $SITE || exit 1
    export PYTHONPATH=$SITE:$PWD
    export PATH=$SITE/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
$PY - <<'PY' 2>&1 | tee -a "$OUT/gpu.txt"
import torch, transformers, ray, lark
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__,
      "ray", ray.__version__, "lark", lark.__version__)
PY
echo "== tests/gpu (serverless on the GPU)"
$PY -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -15 | tee "$OUT/tests_gpu.txt"
echo "== GRPO on CUDA, local backend"
DEV=cuda; $PY -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" || DEV=cpu
/usr/bin/time -f "wall %e s" $PY -m flowrl run examples/grpo_arith.flow --device $DEV --steps ${GRPO_STEPS:-150} \
    --out /tmp/gpu_grpo --overwrite > "$OUT/grpo_cuda.txt" 2>&1
tail -3 "$OUT/grpo_cuda.txt"; cp /tmp/gpu_grpo/metrics.jsonl "$OUT/grpo_metrics.jsonl" 2>/dev/null
echo "== DeepSpeed ZeRO-2 on $DEV (NCCL on CUDA)"
sed -e 's/lr      = 1e-3/lr = 1e-3, engine = "deepspeed", zero_stage = 2/' examples/grpo_arith.flow > /tmp/ds_grpo.flow
sed -i "s#data/arith.jsonl#$PWD/examples/data/arith.jsonl#" /tmp/ds_grpo.flow
/usr/bin/time -f "wall %e s" $PY -m flowrl run /tmp/ds_grpo.flow --device $DEV --steps ${DS_STEPS:-20} \
    --out /tmp/gpu_ds --overwrite > "$OUT/deepspeed.txt" 2>&1
grep -i -E "nccl|gloo|error|Traceback" "$OUT/deepspeed.txt" | head -5; tail -3 "$OUT/deepspeed.txt"
cp /tmp/gpu_ds/metrics.jsonl "$OUT/ds_metrics.jsonl" 2>/dev/null
$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for name in ("grpo_metrics.jsonl", "ds_metrics.jsonl"):
    p = Path(sys.argv[1]) / name
    if not p.exists():
        print(name, "missing"); continue
    rows = [json.loads(l) for l in p.read_text().splitlines()]
    last = rows[-10:]
    print(name, "steps", len(rows), "reward first5 %.3f last10 %.3f" % (
        sum(r["reward_mean"] for r in rows[:5]) / min(5, len(rows)), sum(r["reward_mean"] for r in last) / len(last)),
        "step_s median %.3f" % sorted(r["step_time_s"] for r in rows)[len(rows) // 2])
PY
