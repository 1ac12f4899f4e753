#!/usr/bin/env bash
# The H200 runs behind the README's GPU figures, one step per device call (each call is at most 10 minutes).
#
#   bash benchmarks/gpu.sh part .whl/cuda.part00     # x4: the MLX CUDA wheel arrives in parts (the device tool
#   bash benchmarks/gpu.sh install .whl/cuda.part03 .whl/mlx-0.32.4-*.whl .whl/tqdm-*.whl   # carries 64 MiB a call)
# A fresh machine compiles MLX's CUDA kernels at their first use (about 4 minutes of device time). `ptx-save` brings
# MLX's kernel cache back as $OUT/ptx.tgz (4.5 MB); kept here as .gpu/ptx.tgz and carried, `install` unpacks it and
# the first use takes seconds.
#   bash benchmarks/gpu.sh steps | folder | quant | single | server | media | finetune | memory | photo | budget | parity
#   BEFORE=.gpu/_before PEER=/root/w/peer-python bash benchmarks/gpu.sh cold   # the one-shot command from a cold process
#
# The folder beside mlx-vlm's batch_generate: its 21 wheels (21 MB; benchmarks/peer-gpu-requirements.txt says how
# to download them into .gpu/peer) do not fit in one call beside the repo, so transformers travels first (after
# install):
#   mv .gpu/peer/transformers-*.whl .gpu/                                         # once, here
#   bash benchmarks/gpu.sh peer-part .gpu/transformers-5.24.0-py3-none-any.whl    # carry that file (13.5 MB)
#   bash benchmarks/gpu.sh peer .gpu/peer/*.whl                                   # carry .gpu/peer (7.5 MB)
#   (or `peer-install .gpu/peer/*.whl`: the wheels only, for the `cold` step's PEER=/root/w/peer-python)
#
# Every step writes its JSON under $OUT (the device tool brings it back). PRESET (default 3b) and FOLDER (default
# 64 images) may be set to dry-run a step on a CPU with a small preset; PEER (a python with mlx-vlm 0.7.10, such as
# .bench/venv/bin/python) skips the peer's wheels, PEER_BATCH (default 16) sets the peer step's batch sizes.
set -euo pipefail
W=/root/w
SITE=/root/site
PRESET=${PRESET:-3b}
FOLDER=${FOLDER:-64}
PEER_BATCH=${PEER_BATCH:-16}
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
    [ ! -f .gpu/ptx.tgz ] || tar xzf .gpu/ptx.tgz -C / # MLX's kernel cache (/tmp/mlx/VERSION/ptx)
    ;;
ptx-save)
    tar czf "$OUT/ptx.tgz" -C / tmp/mlx
    exit 0
    ;;
peer-part)
    mkdir -p $W/peer && cp "$@" $W/peer/
    exit 0
    ;;
peer | peer-install) # peer-install: only the wheels (for `cold`: PEER=/root/w/peer-python)
    if [ -z "${PEER:-}" ]; then # mlx-vlm in its own folder, beside MLX's: our side never imports it
        mkdir -p $W/peer
        [ $# -eq 0 ] || cp "$@" $W/peer/ # a rerun on the same machine brings none
        python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /root/peer $W/peer/*.whl
        printf '#!/bin/sh\nPYTHONPATH=%s:/root/peer exec python3 "$@"\n' $SITE >$W/peer-python
        chmod +x $W/peer-python
        PEER=$W/peer-python
    fi
    [ "$step" = peer ] || exit 0
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
    # the same at 16 rows with no vision queued behind the decode steps: what that overlap gives, in one run
    $bench --batch 16 --contexts 1024 --iters 3 --folder "$FOLDER" --modes fast hybrid --max-tokens 48 \
        --tower-ahead 0 --json "$OUT/gpu_folder_ahead_off.json"
    ;;
peer) # the folder beside mlx-vlm's batch_generate: the same random checkpoint (written to disk for both), images,
    # prompt and 48 new tokens at most
    python3 benchmarks/bench.py --preset "$PRESET" --dtype bfloat16 --batch $PEER_BATCH --contexts 1024 --iters 3 \
        --folder "$FOLDER" --modes fast hybrid slow --max-tokens 48 --peer "$PEER" \
        --json "$OUT/gpu_folder_peer_$PRESET.json"
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
parity) # the demo folder at 1 and 16 rows: in bfloat16 (a near tie may break another way at 16 rows, where the
    # GPU's products take other kernels: the JSON says how many images part and where) and in float32 with MLX's
    # TF32 products off, the arithmetic in which batched rows must write one row's tokens
    python3 benchmarks/bench.py --model demo --batch 1 16 --contexts 256 --iters 1 --folder 64 --modes fast hybrid slow \
        --max-tokens 128 --json "$OUT/gpu_parity_demo_bf16.json"
    MLX_ENABLE_TF32=0 python3 benchmarks/bench.py --model demo --dtype float32 --batch 1 16 --contexts 256 --iters 1 \
        --folder 64 --modes fast hybrid slow --max-tokens 128 --json "$OUT/gpu_parity_demo_f32.json"
    python3 benchmarks/parity_probe.py --json "$OUT/gpu_parity_probe_bf16.json" # each differing image's probabilities
    ;;
memory) # peak memory above the weights: single images by phase, folders by rows, bf16 and the quantized 3B, within
    # 16 GB (a 24 GB Mac's GPU share: its budget's 2 GiB of working memory, where the H200's own would be 16 GiB)
    for q in none q8 mixed_4_8; do
        quant=$([ $q = none ] || echo "--quantize $q")
        python3 benchmarks/memory_bench.py --preset $PRESET --in-memory $quant --memory-limit 16 \
            --images 640x480 1920x1080 4032x3024 --rows 1 4 16 --folder 16 --folder-sizes 640x480 1920x1080 \
            --json "$OUT/gpu_memory_$PRESET-$q.json"
    done
    ;;
photo) # one image of 972, 1,989, 3,888 and 6,510 image tokens within 16 GB, each in its own process: each phase's
    # peak, the budget's plan for it, and prefill calls by rows and cached keys
    python3 benchmarks/memory_bench.py --preset $PRESET --in-memory --memory-limit 16 --alone \
        --images 1008x756 1424x1068 2016x1512 4032x3024 --prefill-probe 1280x0 1280x2560 1280x5120 768x5888 \
        --json "$OUT/gpu_memory_${PRESET}_limit16_alone.json"
    ;;
cold) # the one-shot command from a cold process (the checkpoint on disk in the HF layout, a 640x480 and a 12 MP
    # JPEG, smooth as a photo: noise at 1/32 of the size, upsampled): ours, beside BEFORE (an older checkout, e.g.
    # `git archive` into .gpu/_before) and PEER's `python -m mlx_vlm.generate` (after `gpu.sh peer-install`:
    # $W/peer-python) where set; each side's first run untimed
    mkdir -p /root/dt
    [ -f /root/dt/$PRESET/config.json ] || python3 -m mlx_locate.weights.random_checkpoint --preset $PRESET --out /root/dt/$PRESET
    python3 -c "import numpy as np; from PIL import Image
for name, (w, h) in {'small': (640, 480), 'photo': (4032, 3024)}.items():
    pixels = np.random.default_rng(0).integers(0, 256, (h // 32, w // 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).resize((w, h), Image.BICUBIC).save(f'/root/dt/{name}.jpg', quality=90)"
    # the device sets PYTHONDONTWRITEBYTECODE=1: every side's bytecode is compiled ahead, as a pip install leaves it
    python3 -m compileall -q -j 0 $SITE ${PEER:+/root/peer} mlx_locate ${BEFORE:+$BEFORE} >/dev/null || true
    python3 benchmarks/cold_start.py --model /root/dt/$PRESET --images /root/dt/small.jpg /root/dt/photo.jpg --runs 3 \
        ${BEFORE:+--before $BEFORE} ${PEER:+--peer $PEER} --note "H200, MLX CUDA $(python3 -c 'import mlx.core as mx; print(mx.__version__)')" \
        --json "$OUT/gpu_cold_start_$PRESET.json"
    ;;
budget) # a folder of 64 at 16 rows by working memory (bf16, or QUANT), each phase's peak
    quant=$([ -z "${QUANT:-}" ] || echo "--quantize $QUANT")
    python3 benchmarks/memory_bench.py --preset $PRESET --in-memory $quant --images --rows 16 --folder "$FOLDER" \
        --max-tokens 48 --working 2 1 0.5 --json "$OUT/gpu_budget_$PRESET-${QUANT:-bf16}.json"
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
ls -la "$OUT"
