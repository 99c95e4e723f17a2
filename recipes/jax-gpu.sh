#!/usr/bin/env bash
# JAX on one GPU, end to end (docs/performance.md#still-owed): the de->en anchor recipe trained
# with JAX (bfloat16 and the fused attention kernels, the GPU defaults), its last 10 checkpoints
# averaged and evaluated as the CPU figure was (beam 5, alpha 1.4, lowercased Moses BLEU on
# test_2016_flickr: 43.42 on the CPU); then aiayn bench's base and big steps in bfloat16, JAX
# against torch eager and torch.compile, with MFU against the matmul peak measured in the same process.
#   bash recipes/jax-gpu.sh [OUT]   (from the repository root; OUT defaults to /tmp/jax-gpu)
set -euo pipefail
OUT=${1:-/tmp/jax-gpu}
mkdir -p "$OUT"
python -m train.run --config recipes/multi30k-de-en-anchor-pre.toml --run-dir "$OUT/run" --no-progress \
  2>&1 | tee "$OUT/train.log"
aiayn average --run-dir "$OUT/run" --last 10 --dst "$OUT/run-avg10"
aiayn evaluate --run-dir "$OUT/run-avg10" --checkpoint latest --beam 5 --alpha 1.4 --lowercase --moses en \
  --data de:en:../shared/data/multi30k/test_2016_flickr 2>&1 | tee "$OUT/evaluate.log"
aiayn bench --presets base,big --precisions bfloat16 --batch-tokens 16384 --length 64 \
  --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
