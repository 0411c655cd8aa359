#!/usr/bin/env bash
# Every GPU measurement of issue 17, and the tokenizer on a GPU (issue 13), in one run, <= 8 minutes on one
# H200; each table goes to a file in $OUT.
#
#   bash benchmarks/gpu_suite.sh            # on the GPU machine, from the repository root
#   bash benchmarks/gpu_suite.sh --smoke    # CPU, tiny sizes, one step each: that the suite runs (tests)
#
# Files under $OUT (default ./gpu_suite_out): tables.md (every section's table, appended as it ends),
# suite.log (all output, each section's wall time), env.txt, and raw.tar.gz (each section's own file and
# JSON rows; the folder raw/ if the run is cut short). The device tool brings back 8 files at most: hence
# the bundle. The sections (raw/):
#   env.txt              GPU, driver, torch / transformers / accelerate versions
#   bench_gpu.md/.json   our step, base (batch 64) and large (32), bf16 and fp16, frontend conv vs gemm:
#                        s/step, audio-s/s, MFU vs the 989 TFLOP/s spec and vs the same-run 8192^3 matmul
#   profile.txt          torch.profiler's top kernels of 3 base bf16 steps (conv frontend)
#   bench_gpu_compile.md train.compile (frontend + encoder), large and base bf16; "warmup s" = compile time
#   peer.md/.json        ours vs transformers.HubertModel (our heads and loss), base batch 64, bf16/fp16, pre/post
#   frontend.md/.json    the conv frontend alone, conv vs gemm, batch 64, bf16/fp16
#   checkpoint.md/.json  training-loop time blocked per checkpoint, large: synchronous vs background write
#   fp16_modes.md/.json  fp16 as fairseq computes it (half model, fp32 masters) vs amp (autocast) vs fp32:
#                        s/step, steps/s and peak memory, base (batch 16) and large (batch 8), 5.12 s crops
#   fp16_overflow.md     each study recipe at base size, fairseq fp16, 200 steps at 10x MERT-330M's lr
#                        (1.5e-2): overflow steps, loss scale, skipped/diverged (study_overflow.py; tokens)
#   tokenize.md          the tokenizer on the CPU (16 workers) and on the GPU, the same tracks and weights
#                        (made there by make-weights from the same audio): equal codes per codebook, real-time
#                        factor of each (bench_tokenize.py devices); skipped without .gpu_data/audio
#   loop.md/.json        the real loop (study recipe, large fp16, batch 8 x 5.12 s, 2 loader workers, real
#                        tokens) vs the synthetic step at the same batch; skipped without tokens
#   suite.log            everything printed, with each section's wall time
#
# The GPU machine has torch, transformers and accelerate but not `datasets` (the real loop's loader needs
# it) nor a tokenized corpus: benchmarks/gpu_prep.sh (run here, with a registry) puts the wheels in .whl/
# and a slice of a real tokenized dataset in .gpu_data/tokens; name both in the device tool's carry.
# Tokens elsewhere: GPU_SUITE_DATA=<tokenized dataset>.
set -u -o pipefail
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT=${OUT:-$PWD/gpu_suite_out}
mkdir -p "$OUT/raw"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the package from this tree (not installed there)
LOG="$OUT/suite.log"
: >"$LOG"
T0=$SECONDS
BUDGET=${GPU_SUITE_BUDGET_S:-470}   # the whole suite; a section that would start past it is skipped
[ $SMOKE = 1 ] && BUDGET=${GPU_SUITE_BUDGET_S:-1200}  # a shared CPU can be slow: limits only against a hang

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ $SMOKE = 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || echo "wheel install failed (see suite.log)" | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# section NAME TIMEOUT_S OUTFILE CMD...: runs CMD with a time limit, its stdout into raw/OUTFILE, the log
# and tables.md; a failure or timeout is written there too and the suite goes on.
section() {
  local name=$1 limit=$2 outfile=$OUT/raw/$3
  shift 3
  local left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -le 10 ]; then
    echo "SKIPPED $name: the suite's budget of ${BUDGET} s is spent" | tee -a "$LOG" >"$outfile"
  else
    [ "$limit" -gt "$left" ] && limit=$left
    local t=$SECONDS
    echo "=== $name (limit ${limit} s) ===" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" 2>>"$LOG" | tee -a "$LOG" >"$outfile"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && echo "FAILED $name: exit status $rc (124: over its ${limit} s limit); see suite.log" \
      | tee -a "$LOG" >>"$outfile"
    echo "=== $name: $((SECONDS - t)) s (suite so far $((SECONDS - T0)) s) ===" | tee -a "$LOG"
  fi
  printf '\n## %s\n\n' "$name" >>"$OUT/tables.md"
  cat "$outfile" >>"$OUT/tables.md"
}

# skip NAME OUTFILE REASON
skip() {
  echo "SKIPPED $1: $3" | tee -a "$LOG" >"$OUT/raw/$2"
  printf '\n## %s\n\nSKIPPED: %s\n' "$1" "$3" >>"$OUT/tables.md"
}

# bundle: raw/ into raw.tar.gz (the device tool brings back 8 files at most)
bundle() {
  tar -czf "$OUT/raw.tar.gz" -C "$OUT" raw && rm -rf "$OUT/raw"
  echo "suite done in $((SECONDS - T0)) s" | tee -a "$LOG"
}

DATA=${GPU_SUITE_DATA:-.gpu_data/tokens}
AUDIO=${GPU_SUITE_AUDIO:-.gpu_data/audio}
# the weights for the tokenizer section: GPU_SUITE_WEIGHTS, else made there from $AUDIO (the same bytes on
# every CPU measured), into its work folder
WEIGHTS=(${GPU_SUITE_WEIGHTS:+--weights "$GPU_SUITE_WEIGHTS"})
{
  date -u
  echo "smoke=$SMOKE data=$DATA"
  if [ $SMOKE = 0 ]; then  # the versions (importing transformers alone takes seconds: not in the smoke run)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
    $PY -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
    $PY -c "import pyarrow; print('pyarrow', pyarrow.__version__)" 2>&1 | tail -1
    $PY -c "import datasets; print('datasets', datasets.__version__)" 2>&1 | tail -1
  fi
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >>"$LOG"
printf '# gpu_suite.sh tables (%s)\n\n```\n%s\n```\n' "$(date -u +%FT%TZ)" "$(cat "$OUT/env.txt")" >"$OUT/tables.md"

if [ $SMOKE = 1 ]; then  # every section once, as small as it goes: that the suite runs, not what it measures
  DEV=(--device cpu)
  section bench_gpu 300 bench_gpu.md $PY benchmarks/bench_gpu.py "${DEV[@]}" --sizes tiny --dtypes fp32 --batch 1 \
    --seconds 0.5 --steps 1 --warmup 1 --frontend gemm --profile "$OUT/profile.txt" --json "$OUT/raw/bench_gpu.json"
  section peer 300 peer.md $PY benchmarks/bench_gpu_peer.py "${DEV[@]}" --size tiny --dtypes fp32 --schemes pre \
    --batch 1 --seconds 0.5 --steps 1 --warmup 1 --json "$OUT/raw/peer.json"
  section frontend 300 frontend.md $PY benchmarks/bench_frontend.py "${DEV[@]}" --conv-dim 16 --batch 1 --seconds 0.5 \
    --dtypes fp32 --repeats 1 --json "$OUT/raw/frontend.json"
  section checkpoint 300 checkpoint.md $PY benchmarks/bench_checkpoint.py "${DEV[@]}" --sizes tiny --rounds 1 \
    --dir "${TMPDIR:-/tmp}/gpu_suite_ckpt_$$" --json "$OUT/raw/checkpoint.json"
  section fp16_modes 300 fp16_modes.md $PY benchmarks/bench_fp16.py "${DEV[@]}" --layers 1 --batch 1 --seconds 0.5 \
    --rounds 1 --warmup 1 --json "$OUT/raw/fp16_modes.json"
  if [ -d "$DATA" ]; then
    section loop 300 loop.md $PY benchmarks/bench_gpu_loop.py "${DEV[@]}" --data "$DATA" --config recipes/tiny.yaml \
      --size tiny --dtype fp32 --batch 1 --seconds 0.5 --workers 0 --steps 2 --log-every 1 --skip-rows 0 \
      --synthetic-steps 1 --out "$OUT/raw/loop"
    section fp16_overflow 300 fp16_overflow.md $PY benchmarks/study_overflow.py "${DEV[@]}" --data "$DATA" \
      --overlay recipes/overlays/tiny.yaml --steps 2 --recipes study_prenorm_attnrelax_clip1 \
      --set data.batch_size=1 data.crop_seconds=0.5 data.eval_fraction=0 --out "${TMPDIR:-/tmp}/gpu_suite_overflow_$$"
  else
    skip loop loop.md "no tokenized dataset at $DATA"
  fi
  if [ -d "$AUDIO" ]; then
    section tokenize 300 tokenize.md $PY benchmarks/bench_tokenize.py devices --audio "$AUDIO" --tracks 1 \
      --devices cpu cpu --work "${TMPDIR:-/tmp}/gpu_suite_tok_$$" "${WEIGHTS[@]}"
  else
    skip tokenize tokenize.md "no audio at $AUDIO"
  fi
  bundle
  exit 0
fi

# GPU. Order: fp16 as MERT computed it first (the study stands on it), then issue 17's table, then the rest.
section fp16_modes 120 fp16_modes.md bash -c "$PY benchmarks/bench_fp16.py --device cuda --size base --batch 16 \
  --seconds 5.12 --rounds 8 --json $OUT/raw/fp16_base.json && $PY benchmarks/bench_fp16.py --device cuda \
  --size large --batch 8 --seconds 5.12 --rounds 8 --json $OUT/raw/fp16_large.json"
if [ -d "$DATA" ]; then
  section fp16_overflow 150 fp16_overflow.md $PY benchmarks/study_overflow.py --data "$DATA" --lr 1.5e-2 \
    --steps 200 --out /tmp/gpu_suite_overflow
else
  skip fp16_overflow fp16_overflow.md "no tokenized dataset at $DATA (benchmarks/gpu_prep.sh makes one)"
fi
section bench_gpu 150 bench_gpu.md $PY benchmarks/bench_gpu.py --sizes base large --dtypes bf16 fp16 \
  --frontend conv gemm --steps 15 --warmup 3 --profile "$OUT/profile.txt" --json "$OUT/raw/bench_gpu.json"
section peer 60 peer.md $PY benchmarks/bench_gpu_peer.py --size base --batch 64 --dtypes bf16 fp16 \
  --schemes pre post --steps 8 --warmup 2 --json "$OUT/raw/peer.json"
section frontend 30 frontend.md $PY benchmarks/bench_frontend.py --device cuda --batch 64 --dtypes bf16 fp16 \
  --repeats 10 --json "$OUT/raw/frontend.json"
if [ -d "$DATA" ]; then
  section loop 90 loop.md $PY benchmarks/bench_gpu_loop.py --data "$DATA" \
    --config recipes/study_prenorm_clip1_run2.yaml --size large --dtype fp16 --batch 8 --seconds 5.12 \
    --workers 2 --steps 150 --log-every 10 --skip-rows 3 --out "$OUT/raw/loop"
else
  skip loop loop.md "no tokenized dataset at $DATA (benchmarks/gpu_prep.sh makes one)"
fi
section checkpoint 60 checkpoint.md $PY benchmarks/bench_checkpoint.py --device cuda --sizes large --rounds 2 \
  --dir /tmp/gpu_suite_ckpt --json "$OUT/raw/checkpoint.json"
if [ -d "$AUDIO" ]; then
  section tokenize 90 tokenize.md $PY benchmarks/bench_tokenize.py devices --audio "$AUDIO" --tracks 4 \
    --devices cpu cuda --work /tmp/gpu_suite_tok "${WEIGHTS[@]}"
else
  skip tokenize tokenize.md "no audio at $AUDIO (benchmarks/gpu_prep.sh copies some)"
fi
section bench_gpu_compile 150 bench_gpu_compile.md $PY benchmarks/bench_gpu.py --sizes large base --dtypes bf16 \
  --compile --steps 15 --warmup 3 --json "$OUT/raw/bench_gpu_compile.json"
bundle
