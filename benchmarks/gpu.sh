#!/usr/bin/env bash
# The H200 runs behind the README's GPU figures, one step per device call (each call is at most 10 minutes).
#
#   bash benchmarks/gpu.sh part .whl/cuda.part00     # x4: the MLX CUDA wheel arrives in parts (the device tool
#   bash benchmarks/gpu.sh install .whl/cuda.part03 .whl/mlx-0.32.4-*.whl .whl/tqdm-*.whl   # carries 64 MiB a call)
#   bash benchmarks/gpu.sh steps | folder | quant | single | server | media | finetune | memory
#
# Every step writes its JSON under $OUT (the device tool brings it back). PRESET (default 3b) and FOLDER (default
# 64 images) may be set to dry-run a step on a CPU with a small preset.
set -euo pipefail
W=/root/w
SITE=/root/site
PRESET=${PRESET:-3b}
FOLDER=${FOLDER:-64}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
step=$1
shift
case $step in
part)
    mkdir -p $W && cp "$@" $W/
    exit 0
    ;;
install)
    mkdir -p $W && cp "$@" $W/
    cat $W/cuda.part* >$W/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl && rm $W/cuda.part*
    python3 -m pip install -q --no-deps --no-index --no-compile --target $SITE $W/*.whl
    ;;
esac
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())"
bench="python3 benchmarks/bench.py --preset $PRESET --in-memory --dtype bfloat16"
case $step in
install) ;;
steps) # the step's cost by sequences per step, at 1,024 cached tokens each; the floor (a 6.4 GB read-only pass)
    $bench --batch 1 2 4 8 16 32 64 --contexts 1024 --folder 0 --modes fast --json "$OUT/gpu_steps_$PRESET.json"
    ;;
folder) # a folder of 640x480 images, one query each, at 1 and 16 sequences (and between), every mode
    $bench --batch 1 4 16 64 --contexts 1024 --iters 3 --folder "$FOLDER" --modes fast hybrid slow \
        --max-tokens 48 --json "$OUT/gpu_folder_$PRESET.json"
    ;;
quant) # the q8 and mixed_4_8 conversions of the same random weights
    for q in q8 mixed_4_8; do
        $bench --quantize $q --batch 1 16 --contexts 1024 --iters 5 --folder "$FOLDER" --modes fast hybrid \
            --max-tokens 48 --json "$OUT/gpu_folder_$PRESET-$q.json"
    done
    ;;
mix) # block and AR rows in one forward or in two: the schedule, measured
    for s in mixed split; do
        $bench --batch 16 --contexts 1024 --iters 3 --folder "$FOLDER" --modes mix --schedule $s --max-tokens 48 \
            --json "$OUT/gpu_schedule_$s.json"
    done
    ;;
single) # one request at a time, as before the engine (ours only: no mlx-vlm wheels carried)
    $bench --images 640x480 1920x1080 --contexts 512 2048 --repeat 3 --max-tokens 48 --json "$OUT/gpu_single_$PRESET.json"
    ;;
server) # concurrent clients on the engine's worker thread, in process
    python3 benchmarks/load_server.py --preset "$PRESET" --in-memory --clients 1 4 16 64 --requests 64 \
        --modes fast --max-tokens 48 --json "$OUT/gpu_server_$PRESET.json"
    ;;
media) # the demo model (real boxes): the folder by batch size; tiling recall and video frames/s
    python3 benchmarks/bench.py --model demo --batch 1 4 16 --contexts 256 --iters 3 --folder "$FOLDER" \
        --modes fast hybrid slow --max-tokens 128 --json "$OUT/gpu_folder_demo.json"
    python3 benchmarks/tiles_video_bench.py --note "H200, MLX CUDA 0.32.4" --json "$OUT/gpu_tiles_video.json"
    ;;
finetune)
    python3 benchmarks/finetune_bench.py --json "$OUT/gpu_finetune.json"
    ;;
memory) # peak memory above the weights: single images by phase, folders by rows, bf16 and the quantized 3B
    for q in none q8 mixed_4_8; do
        quant=$([ $q = none ] || echo "--quantize $q")
        python3 benchmarks/memory_bench.py --preset $PRESET --in-memory $quant --images 640x480 1920x1080 4032x3024 \
            --rows 1 4 16 --folder 16 --folder-sizes 640x480 1920x1080 --json "$OUT/gpu_memory_$PRESET-$q.json"
    done
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
ls -la "$OUT"
