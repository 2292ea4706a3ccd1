#!/usr/bin/env bash
# Build, test and benchmark groupgrad's CUTLASS kernels on an offline GPU box, from a
# source checkout, without installing anything but carried wheels.
#
# usage: benchmarks/run_kernels_on_gpu.sh OUT_DIR [tests|bench|all] [bench args, e.g. --tuning]
#   - wheels found in ./.whl (e.g. nvidia-cutlass) are installed into /tmp/site;
#   - the build cache is ./.kcache (GROUPGRAD_KERNELS_CACHE) unless already set;
#   - with --tuning the tuning variant set compiles concurrently with the default one;
#   - logs, the benchmark JSON/PNG and a tarball of the built extensions land in OUT_DIR.
set -uo pipefail
out=${1:?usage: $0 OUT_DIR [tests|bench|all] [bench args...]}
what=${2:-all}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
tuning=0
for arg in "$@"; do [[ "$arg" == --tuning ]] && tuning=1; done

export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16}
export GROUPGRAD_KERNELS_CACHE=${GROUPGRAD_KERNELS_CACHE:-$root/.kcache}
site=""
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  site=/tmp/site:
fi
export PYTHONPATH=${site}$root/kernels/src:$root/packages/protocol/src${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv | tee "$out/gpu.txt"

# Both variant sets at once: their translation units share the cores.
python3 -m groupgrad.kernels.build > "$out/build_default.log" 2>&1 &
default_pid=$!
if [[ "$what" != tests && $tuning == 1 ]]; then
  python3 -m groupgrad.kernels.build --set tuning > "$out/build_tuning.log" 2>&1 &
  tuning_pid=$!
fi
wait $default_pid || { tail -50 "$out/build_default.log"; exit 1; }
tail -1 "$out/build_default.log"
if [[ "$what" != tests && $tuning == 1 ]]; then
  wait $tuning_pid || tail -50 "$out/build_tuning.log"
  tail -1 "$out/build_tuning.log"
fi
tar -C "$GROUPGRAD_KERNELS_CACHE" -czf "$out/kcache.tgz" \
  --exclude='*.o' --exclude='*.ninja*' --exclude='generated' --exclude='lock' . 2>/dev/null

status=0
if [[ "$what" != bench ]]; then
  timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=120 kernels/tests \
    > "$out/tests.log" 2>&1 || status=1
  tail -25 "$out/tests.log"
fi
if [[ "$what" != tests ]]; then
  timeout 280 python3 benchmarks/bench_kernels.py --out "$out" "$@" \
    > "$out/bench.log" 2>&1 || status=1
  grep -v "^|" "$out/bench.log" | tail -60
fi
exit $status
