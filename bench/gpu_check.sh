#!/usr/bin/env bash
# Everything a lent GPU should check, as one device call (a session gets ~15 device-minutes, all
# tries and the machine's start counted): the `gpu`-marked tests first (correctness of the CUDA
# paths, which no CPU run covers), then the GPU benchmarks, each step bounded so that the ones
# after it still run and each one's log comes back under $OUT (summary.txt: a line per step).
#
# Here, once a session:   bash bench/gpu_wheels.sh          (the packages the image lacks, .whl/)
# Then one device call:   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=560)
# GPU_CHECK_SECONDS (default 500) is the whole script's budget; GPU_CHECK_STEPS picks steps
# (default "env tests kvtests model kernels quant throughput"); the step limits add up to 500.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
budget=${GPU_CHECK_SECONDS:-500}
steps=${GPU_CHECK_STEPS:-env tests kvtests model kernels quant throughput}
export PYTHONUNBUFFERED=1 LITELLM_LOCAL_MODEL_COST_MAP=True HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python=${PYTHON:-python3}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-site .whl/*.whl >"$out/install.log" 2>&1 || { echo "wheel install failed"; tail "$out/install.log"; }
    export PYTHONPATH=/tmp/gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# step NAME SECONDS COMMAND...: run it within SECONDS (less when the budget is nearly spent)
step() {
    local name=$1 limit=$2
    shift 2
    case " $steps " in *" $name "*) ;; *) return 0 ;; esac
    local left=$((budget - SECONDS))
    if ((left < 30)); then
        echo "$name: skipped, the budget is spent" | tee -a "$out/summary.txt"
        return 0
    fi
    ((limit > left - 10)) && limit=$((left - 10))
    local began=$SECONDS rc=0
    echo "== $name (at most ${limit} s)"
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
    echo "$name: exit $rc after $((SECONDS - began)) s$( ((rc == 124)) && echo ' (timed out)')" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
}

step env 20 bash -c "nvidia-smi; $python -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'"
# the gpu-marked tests, spread over 4 processes (each engine in them has a fixed, small KV pool)
step tests 180 "$python" -m pytest -q -p no:cacheprovider -m gpu -n 4 --dist load -rfE \
    tests/kernels tests/engine/test_kernel_backends.py tests/engine/test_quant.py
# the quantized KV cache's kernels (fp8 exists only on the GPU): these files run on CUDA when present
step kvtests 50 "$python" -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_kv_quant.py tests/kernels/test_store_kv.py
# the 1B model the benchmarks share, built (and saved whole) before they start
step model 50 "$python" -c "from bench.engine_throughput import random_llama_1b; print(random_llama_1b())"
step kernels 50 "$python" bench/kernels.py --quick
step quant 70 "$python" bench/quant_gpu.py --quick
step throughput 80 "$python" bench/engine_throughput.py --device cuda --model llama-1b --quick --skip-hf
echo "logs: $out"
