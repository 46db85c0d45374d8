#!/usr/bin/env bash
# The GPU check of the preference stages and multi-turn tools (issue 26, 27), run like bench/gpu_check.sh (its setup:
# wheels in .whl/): both preference pipelines judged by the hidden rule (bench/pipeline_sums.py) on CUDA, the
# calculator-tool example on CUDA, and tests/gpu (the serverless backend on the GPU) once more.
# Usage: bash bench/gpu_check2.sh OUTDIR
set -uo pipefail
OUT=${1:-/tmp/gpu_check2}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -d .whl ] && ! $PY -c "import ray, lark" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    tar xJf .whl/ray.tar.xz -C /tmp/site || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')"
echo "== preference pipelines on $($PY -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')"
/usr/bin/time -f "wall %e s" $PY bench/pipeline_sums.py --out /tmp/ps 2>&1 | tee "$OUT/pipelines.txt"
grep -h "step_time_s" /dev/null; $PY - <<'PY' | tee -a "$OUT/pipelines.txt"
import json, statistics
for flow in ("sums_pipeline", "sums_dpo"):
    rows = [json.loads(l) for l in open(f"/tmp/ps/{flow}/metrics.jsonl")]
    for st in dict.fromkeys(r["stage"] for r in rows):
        t = [r["step_time_s"] for r in rows if r["stage"] == st]
        print(flow, st, "steps", len(t), "median step %.4f s" % statistics.median(t))
PY
echo "== calc_tool on CUDA"
DEV=cuda; $PY -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" || DEV=cpu
/usr/bin/time -f "wall %e s" $PY -m flowrl run examples/calc_tool.flow --device $DEV --out /tmp/calc --overwrite --quiet 2>&1 | tail -4 | tee "$OUT/calc.txt"
$PY - <<'PY' | tee -a "$OUT/calc.txt"
import json
rows = [json.loads(l) for l in open("/tmp/calc/metrics.jsonl")]
last = rows[-10:]
print("calc_tool steps", len(rows), "reward first10 %.3f last10 %.3f" % (sum(r["reward_mean"] for r in rows[:10]) / 10,
      sum(r["reward_mean"] for r in last) / len(last)), "tool calls last10 %.2f" % (sum(r["env/tool_calls_mean"] for r in last) / len(last)))
PY
echo "== tests/gpu"
$PY -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -3 | tee "$OUT/tests_gpu.txt"
