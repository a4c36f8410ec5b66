#!/usr/bin/env bash
# Everything a lent GPU machine is asked in one go (docs/performance.rst, "On a
# GPU"): the world-size-1 step against torch's FSDP1 and the plain module on a
# quiet machine first, then tests/test_cuda.py on the GPU while the CPU suite
# runs beside it on that machine's torch (an older one than CI's).
#
#     OUT=/tmp/cuda bash benchmarks/cuda_session.sh [steps|tests|all] [SECONDS]
#
# SECONDS bounds the CPU suite (default 300).  Logs go to $OUT.  bitsandbytes
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

if [ "$what" = steps ] || [ "$what" = all ]; then
    echo "==> world size 1, bf16, gpu workload (303M)"
    timeout 150 $PY benchmarks/bench_fsdp.py --device cuda --nproc 1 --workloads gpu \
        --mem-workload gpu --mixed-precision bf16 --frameworks torch_fsdp1,fsdp_wrap,plain \
        --strategies FULL_SHARD --no-meta 2>&1 | tee "$OUT/bench_gpu.log" | grep -v "^\s*$" | tail -30
    echo "==> profile (gpu workload, bf16)"
    timeout 90 $PY benchmarks/profile_cuda.py --workload gpu --mixed-precision bf16 \
        >"$OUT/profile.log" 2>&1
    grep -E "step|busy|wall|ms" "$OUT/profile.log" | head -20
fi

if [ "$what" = tests ] || [ "$what" = all ]; then
    echo "==> CPU suite on this torch (background, ${suite_s} s)"
    ( timeout "$suite_s" $PY -m pytest -q -p no:cacheprovider -x --ignore=tests/test_cuda.py \
        >"$OUT/suite.log" 2>&1; echo "suite exit $?" >>"$OUT/suite.log" ) &
    suite=$!
    echo "==> tests/test_cuda.py"
    timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py -rfEs \
        >"$OUT/cuda.log" 2>&1
    echo "test_cuda exit $?"
    grep -E "passed|failed|FAILED|ERROR|Error" "$OUT/cuda.log" | tail -25
    wait $suite
    grep -E "passed|failed|FAILED|suite exit" "$OUT/suite.log" | tail -15
fi
