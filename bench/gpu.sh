#!/usr/bin/env bash
# Device benchmarks for a lent GPU (H200): the sampler's decode throughput and roofline share,
# then the train step (bench/train.py, when that file exists). Each prints one-line figures.
#
#   bash bench/gpu.sh            on the GPU machine (jax with CUDA installed)
#   bash bench/gpu.sh --smoke    on a CPU: shrunken models, checks that the script runs
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

SMOKE=""
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE="--smoke" ;;
    *) echo "bench/gpu.sh: unknown argument '$arg' (only --smoke)" >&2; exit 2 ;;
  esac
done
if [ -n "$SMOKE" ]; then
  export JAX_PLATFORMS=cpu
fi

python -c "import jax; print('jax', jax.__version__, 'devices:', jax.devices())" || { echo "FAILED: jax import"; exit 1; }
if [ -z "$SMOKE" ] && ! python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  echo "bench/gpu.sh: no GPU backend in jax (use --smoke on a CPU)" >&2
  exit 1
fi

status=0
python bench/sampler.py --gpu $SMOKE || { echo "FAILED: bench/sampler.py --gpu $SMOKE"; status=1; }
if [ -f bench/train.py ]; then
  python bench/train.py --gpu $SMOKE || { echo "FAILED: bench/train.py --gpu $SMOKE"; status=1; }
else
  echo "skipped: bench/train.py does not exist yet"
fi
exit $status
