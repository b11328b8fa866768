#!/usr/bin/env bash
# Every check that needs a GPU, in one call of a lent GPU machine (which has CUDA's PyTorch but not
# all of tokenmill's dependencies: the missing ones travel as wheels in .whl/, see below).
#
#   bash bench/cuda_check.sh [OUT_DIR] [STEPS]
#
# STEPS (default "tests smoke offline serve"), in this order, each under its own time limit:
#   tests    the CUDA cases of the suite (engine, attention, model parity, quantized layers,
#            speculative decoding, KV cache quantization) -> OUT/pytest.log, OUT/junit.xml
#   smoke    bench/cuda_smoke.py: batch-1 decode tok/s per dtype beside HF transformers, on a
#            SmolLM2-sized random checkpoint (no weights travel) -> OUT/cuda_smoke.json
#   offline  bench/offline_throughput.py --device cuda, bfloat16, tokenmill vs HF static batches
#            -> OUT/offline_throughput.json
#   serve    tokenmill serve --device cuda + tokenmill bench serve at concurrency 1, 16, 64
#            -> OUT/serve-c*.json
#   stash    copies .carry1/ (the first part of SmolLM2's GGUF) to /tmp/parts, for a later call
#   distill  SmolLM2 (/tmp/parts/p1 + .carry2/p2, checked against .carry2/sha256) pruned to the
#            half-size plan (30 layers, 2 KV groups, FFN 672) and distilled into for a time budget
#            (bench/distill_budget.py, embedding frozen, the corpus from .carry2/corpus.txt.gz);
#            the student's other tensors split into /tmp/chunks/student-N.safetensors
#   pack     the small result files into OUT/results.tgz, and the first 4 chunks into OUT
#   chunks   the remaining chunks into OUT (a later call, while the machine is still warm)
#
# The wheels (Python 3.12, for the machine's image; fetched here once, never committed):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 fastapi==0.165.0 \
#     starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     uvicorn==0.55.0 opentelemetry-api==1.45.2 transformers==5.24.0
set -u
OUT_DIR=${1:-${OUT:-/tmp/cuda_check}}
STEPS=${2:-tests smoke offline serve}
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENMILL_CPU_KERNELS=0 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(), 'transformers', transformers.__version__)"
MODEL=/tmp/smollm2-random
random_model() {  # the SmolLM2-sized random checkpoint, made once (the smoke step makes it too)
  [ -f $MODEL/config.json ] || timeout 60 python3 -c "import sys; sys.path.insert(0, 'bench'); \
from pathlib import Path; from cuda_smoke import save_random_smollm2; save_random_smollm2(Path('$MODEL'))"
}

for step in $STEPS; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT_DIR/junit.xml" -k cuda \
        tests/engine/test_devices.py tests/engine/test_cuda_features.py tests/attention/test_paged.py \
        tests/models/test_parity_tiny.py 2>&1 | tee "$OUT_DIR/pytest.log" | tail -40 ;;
    smoke)
      timeout 100 python3 bench/cuda_smoke.py --model-dir $MODEL --out "$OUT_DIR/cuda_smoke.json" 2>&1 \
        | grep -v "it/s\]" ;;
    offline)
      random_model
      timeout 130 python3 bench/offline_throughput.py --device cuda --model $MODEL --dtype bfloat16 \
        --num-requests 128 --max-batch 64 --output-range 16 256 --out "$OUT_DIR/offline_throughput.json" 2>&1 \
        | grep -v "it/s\]" ;;
    serve)
      random_model
      python3 -m tokenmill serve $MODEL --device cuda --port 8123 > "$OUT_DIR/serve.log" 2>&1 &
      server=$!
      for _ in $(seq 60); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 1; done
      for c in 1 16 64; do
        n=$(( c < 8 ? 8 : 2 * c ))
        timeout 45 python3 -m tokenmill bench serve --base-url http://127.0.0.1:8123 --model $MODEL \
          --num-requests $n --max-concurrency $c --input-len 256 --output-len 128 \
          --out "$OUT_DIR/serve-c$c.json" 2>&1 | grep -v "it/s\]" | tail -25
      done
      kill $server; wait $server 2>/dev/null
      tail -5 "$OUT_DIR/serve.log" ;;
    stash)
      mkdir -p /tmp/parts && cp .carry1/* /tmp/parts/ && ls -la /tmp/parts ;;
    distill)
      TEACHER=/tmp/teacher/SmolLM2-135M-Instruct.Q4_1.gguf
      mkdir -p /tmp/teacher ~/.cache/tokenmill/data
      cat /tmp/parts/p1 .carry2/p2 > $TEACHER && (cd /tmp/teacher && sha256sum -c "$OLDPWD/.carry2/sha256") || {
        echo "no teacher (the first part did not survive between calls)"; continue; }
      gunzip -c .carry2/corpus.txt.gz > ~/.cache/tokenmill/data/shakespeare.txt
      timeout 150 python3 -m tokenmill prune $TEACHER --method structured --num-kv-heads 2 --intermediate-size 672 \
        --out /tmp/half --device ${DEVICE:-cuda} 2>&1 | grep -v "it/s\]" | tail -8
      timeout 330 python3 bench/distill_budget.py --teacher $TEACHER --student /tmp/half --out /tmp/half-kd \
        --seconds ${DISTILL_SECONDS:-200} --device ${DEVICE:-cuda} --freeze-embedding ${DISTILL_ARGS:-} 2>&1 | grep -v "step/s\]" | tail -8
      cp /tmp/half-kd/log.json /tmp/half-kd/loss.png /tmp/half-kd/budget.json "$OUT_DIR/" 2>/dev/null
      mkdir -p "$OUT_DIR/student-meta" /tmp/chunks
      python3 - <<'PY'
import json
from pathlib import Path
from safetensors.torch import load_file, save_file
src, out = Path("/tmp/half-kd/student"), Path("/tmp/chunks")
tensors = load_file(str(src / "model.safetensors"))
chunk, size, index = {}, 0, {}
names = [n for n in tensors if n != "model.embed_tokens.weight"]
for name in names + [None]:
    t = tensors.get(name) if name else None
    if chunk and (name is None or size + t.numel() * t.element_size() > 16_000_000):
        path = out / f"student-{len(index)}.safetensors"
        save_file(chunk, str(path))
        index[path.name] = sorted(chunk)
        chunk, size = {}, 0
    if name:
        chunk[name], size = t.contiguous(), size + t.numel() * t.element_size()
print(json.dumps({k: len(v) for k, v in index.items()}))
json.dump(index, open("/tmp/chunks/index.json", "w"))
PY
      cp /tmp/half-kd/student/*.json /tmp/chunks/index.json "$OUT_DIR/student-meta/" 2>/dev/null
      ls -la /tmp/chunks ;;
    pack)
      (cd "$OUT_DIR" && tar czf /tmp/results.tgz --exclude='student-*.safetensors' . && rm -rf ./* \
        && mv /tmp/results.tgz . )
      for i in 0 1 2 3; do cp /tmp/chunks/student-$i.safetensors "$OUT_DIR/" 2>/dev/null; done
      ls -la "$OUT_DIR" ;;
    chunks)
      for f in /tmp/chunks/student-*.safetensors; do
        case $(basename $f) in student-[0-3].safetensors) ;; *) cp $f "$OUT_DIR/" ;; esac
      done
      ls -la "$OUT_DIR" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "=== done $(date +%T)"
