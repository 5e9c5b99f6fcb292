#!/usr/bin/env bash
# The benchmarks that have GPU targets, in one run on a CUDA machine with JAX, flax, equinox,
# optax and torch installed (masked_jax is taken from this checkout):
#   bash benchmarks/gpu.sh [LOGDIR]
# Each benchmark has its own time limit; logs (and the plots) go to LOGDIR (default
# benchmarks/results/gpu). ONLY="recsys_sweep recsys" runs only those.
set -u
cd "$(dirname "$0")/.."
LOG=${1:-benchmarks/results/gpu}
mkdir -p "$LOG"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$LOG/device.txt"
$PY -c "import jax, flax, equinox, optax, torch, masked_jax; print('jax', jax.__version__, jax.devices(),
'flax', flax.__version__, 'equinox', equinox.__version__, 'optax', optax.__version__, 'torch', torch.__version__)" \
  2>&1 | tee -a "$LOG/device.txt"
ONLY=${ONLY:-recsys_sweep recsys attention maskify_models jacobian}  # which ones, e.g. ONLY="recsys_sweep"
run() {  # run NAME SECONDS ARGS...: one benchmark under its time limit
  local name=$1 limit=$2; shift 2
  case " $ONLY " in *" $name "*) ;; *) return ;; esac
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" $PY "$@" > "$LOG/$name.log" 2>&1
  echo "=== $name: rc $? in $((SECONDS - t0)) s"
}
run recsys_sweep "${SWEEP_S:-200}" benchmarks/recsys.py --sweep-only  # first: the row-sparse bandwidth target
run recsys "${RECSYS_S:-150}" benchmarks/recsys.py --no-sweep
run attention "${ATTENTION_S:-240}" benchmarks/attention.py  # L = 1k to 16k with cuDNN
run maskify_models "${MASKIFY_S:-150}" benchmarks/maskify_models.py
run jacobian "${JACOBIAN_S:-140}" benchmarks/jacobian.py
cp benchmarks/results/*_gpu.png "$LOG/" 2>/dev/null
for f in $ONLY; do [ -f "$LOG/$f.log" ] || continue; echo "##### $f"; grep -v '^\[' "$LOG/$f.log" | tail -n 45; done
