#!/usr/bin/env bash
# Everything a lent GPU machine is asked in one go (docs/performance/gpu.rst): the world-size-1 step against torch's FSDP1 and the plain module on a
# quiet machine first, then tests/test_cuda*.py on the GPU while the CPU suite
# runs beside it on that machine's torch (an older one than CI's).
#
#     OUT=/tmp/cuda bash benchmarks/cuda_session.sh [steps|tests|plan|all|...] [SECONDS]
#
# Modes may be joined with commas (steps,tests).  SECONDS bounds the CPU suite
# (default 300); PROFILE=0 skips the profile; $SUITE names the test files it runs (default: all but
# the two test_cuda files).  plan: benchmarks/plan_accuracy.py on the GPU, where the
# caching allocator counts tensor bytes only.  Logs go to $OUT.  bitsandbytes
# is installed from .whl/ where that folder holds its wheel (the machine has
# no index).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/cuda_session}
mkdir -p "$OUT"
what=${1:-all}
suite_s=${2:-300}
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
PY=python3

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "python", sys.version.split()[0])'
$PY -c 'import bitsandbytes, peft, transformers; print("bitsandbytes", bitsandbytes.__version__, "peft", peft.__version__, "transformers", transformers.__version__)'

want() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }

if want steps; then
    echo "==> world size 1, bf16, gpu workload (303M)"
    timeout 150 $PY benchmarks/bench_fsdp.py --device cuda --nproc 1 --workloads gpu \
        --mem-workload gpu --mixed-precision bf16 --frameworks torch_fsdp1,fsdp_wrap,plain \
        --strategies FULL_SHARD --no-meta 2>&1 | tee "$OUT/bench_gpu.log" | grep -v "^\s*$" | tail -30
    [ "${PROFILE:-1}" = 0 ] || echo "==> profile (gpu workload, bf16)"
    [ "${PROFILE:-1}" = 0 ] || timeout 90 $PY benchmarks/profile_cuda.py --workload gpu --mixed-precision bf16 \
        >"$OUT/profile.log" 2>&1
    [ "${PROFILE:-1}" = 0 ] || grep -E "^##" "$OUT/profile.log"
fi

if want plan; then
    echo "==> plan accuracy on the GPU (2 gloo ranks sharing it, Hugging Face, LoRA, QLoRA)"
    timeout 120 $PY benchmarks/plan_accuracy.py --device cuda --models hf >"$OUT/plan.log" 2>&1
    echo "plan_accuracy exit $?"
    grep -E "^(llama|bert|t5|model)" "$OUT/plan.log" | tail -30
fi

if want tests; then
    echo "==> CPU suite on this torch (background, ${suite_s} s)"
    # shellcheck disable=SC2086
    ( timeout "$suite_s" $PY -m pytest -q -p no:cacheprovider -x ${SUITE:---ignore=tests/test_cuda.py --ignore=tests/test_cuda_features.py} \
        >"$OUT/suite.log" 2>&1; echo "suite exit $?" >>"$OUT/suite.log" ) &
    suite=$!
    echo "==> tests/test_cuda.py tests/test_cuda_features.py"
    timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_features.py -rfEs \
        >"$OUT/cuda.log" 2>&1
    echo "test_cuda exit $?"
    grep -E "passed|failed|FAILED|ERROR|Error" "$OUT/cuda.log" | tail -25
    wait $suite
    grep -E "passed|failed|FAILED|suite exit" "$OUT/suite.log" | tail -15
fi
