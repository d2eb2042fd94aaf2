#!/usr/bin/env bash
# The checks that need a GPU, as one bounded run on a machine with one CUDA device (about 8 minutes on an H200):
#   1. tests/test_gpu.py: every compressor on CUDA tensors with no host sync on the codec path, DDP over NCCL,
#      two ranks sharing the GPU over gloo, CompressedDDP and DiLoCo (offload on and off) under Lightning;
#   2. benchmarks/codec.py on CUDA: encode+decode against the backward pass, kernel launches per step and the
#      sync-debug check, for ResNet-18 (CIFAR shape, batch 128) and ResNet-50 (224x224, batch 64);
#   3. benchmarks/diloco_memory.py: the peak accelerator memory of DiLoCo with offload off and on.
# Run from the repository root, with the package importable (an editable install, or PYTHONPATH=.):
#   OUT=/tmp/gpu bash benchmarks/gpu_checks.sh
# Each part has its own time limit and writes into $OUT; a part that fails does not stop the next.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
COMPRESSORS=(fp16 bf16 topk dgc powersgd powersgd-batched minmax8 minmax4 qsgd terngrad signsgd efsignsgd onebit
             scalecom adacomp randomk)
python3 -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__,
            torch.cuda.get_device_name(0))' | tee "$OUT/env.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$OUT/test_gpu.log" 2>&1
echo "test_gpu.py: exit $? ($(tail -1 "$OUT/test_gpu.log"))"
timeout 150 python3 benchmarks/codec.py --device cuda --batch-size 128 --steps 10 --operators \
    --compressors "${COMPRESSORS[@]}" --out "$OUT/codec_cuda_resnet18.json" > "$OUT/codec_resnet18.md" 2>&1
echo "codec.py ResNet-18: exit $?"
timeout 150 python3 benchmarks/codec.py --device cuda --model resnet50 --image-size 224 --batch-size 64 --steps 10 \
    --operators --compressors "${COMPRESSORS[@]}" --out "$OUT/codec_cuda_resnet50.json" > "$OUT/codec_resnet50.md" 2>&1
echo "codec.py ResNet-50: exit $?"
timeout 60 python3 benchmarks/diloco_memory.py --width 4096 --layers 4 --accelerator gpu > "$OUT/diloco_memory.md" 2>&1
echo "diloco_memory.py: exit $?"
