#!/usr/bin/env bash
# Prepared GPU check of msmon's Megatron adapters: megatron-core GPTModel, TP=PP=1, one GPU,
# DistributedOptimizer and Float16OptimizerWithFloat16Params, 5 steps each under `msmon run`,
# every recorded statistic compared with the whole tensors Megatron holds, losses compared with
# an unmonitored run. Not run yet: no GPU was lent to the session that wrote it.
#
#   bash benchmarks/gpu/run_megatron_gpu.sh          (from the repository root; about 3-5 minutes)
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$(mktemp -d /tmp/msmon-megatron-gpu.XXXX)}
python -c "import megatron.core" 2>/dev/null || pip install -q "megatron-core==0.16.1" wrapt click pyyaml tensorboard
cat > "$OUT/monitor.json" <<'JSON'
{"wg_distribution": true, "param_distribution": true, "mv_distribution": true, "format": ["csv"],
 "ndigits": 12, "squash_name": false, "ops": ["norm", "min", "max", "mean", "nans", "infs"]}
JSON
status=0
for kind in distributed float16; do
  torchrun --standalone --nproc-per-node 1 benchmarks/gpu/megatron_gpt.py --optimizer "$kind" --out "$OUT/plain-$kind"
  python -m msmon.launcher run --config "$OUT/monitor.json" --output-dir "$OUT/mon-$kind/out" \
    --standalone --nproc-per-node 1 -- benchmarks/gpu/megatron_gpt.py --optimizer "$kind" --out "$OUT/mon-$kind"
  python benchmarks/gpu/check_megatron_gpu.py "$OUT/plain-$kind" "$OUT/mon-$kind" "$kind" || status=1
done
echo "outputs in $OUT"
exit $status
