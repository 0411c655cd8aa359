#!/usr/bin/env bash
# Issue 46's GPU measurements in one run on one GPU, in priority order, within a deadline; every table goes to
# files in $OUT as its section ends, so a run stopped at the deadline keeps what it measured.
#
#   bash benchmarks/gpu_suite.sh            # on the GPU machine, from the repository root (at most the deadline)
#   bash benchmarks/gpu_suite.sh --smoke    # CPU, tiny sizes, a step or two each: that the suite runs (the tests)
#
# Sections (GPU_SUITE_SECTIONS, default "step peer compile loop runner", run in the order given):
#   step     bench_gpu.py: the study's step (trainer's precision, fused AdamW, clip) at base (batch 64) and
#            large (32), 5.12 s crops: fairseq-math, fairseq-relax, bf16-sdpa; then the levers fairseq-math+gemm
#            (base, large) and +cudnnbench (base); s/step, audio-s/s, MFU (analytic FLOPs / 989 TFLOP/s), torch's
#            FLOP count as a check, vs an 8192^3 matmul, peak memory, overflowed steps; profile.txt: torch.profiler's
#            top kernels of 3 base fairseq-math steps and the device time by kernel family
#   peer     bench_gpu_peer.py: ours / transformers.HubertModel (our heads and loss), same config and precision,
#            alternating: fairseq-math (peer eager) and bf16-sdpa (peer sdpa), base and large
#   compile  bench_gpu.py --compile: base fairseq-math compiled as train.compile does (frontend + encoder), then
#            frontend + each encoder layer; "warmup s" = compile time (the eager row is in step)
#   loop     bench_gpu_loop.py: the study's real loop (accelerate launch, base fairseq-math, batch 16, 4 loader
#            workers, real tokens, CQT target, metrics, diagnostics, a checkpoint) vs its synthetic step
#   runner   bench_gpu_runner.py: 1, 3, 5, 7 study runs (base, batch 16) sharing the GPU as processes, and one
#            process stepping 3 models in turn: steps/s and steps/min in all, study runs per hour
# Further sections, named in GPU_SUITE_SECTIONS only (issues 13 and 17; not in the default plan): fp16_modes
# (bench_fp16.py), fp16_overflow (study_overflow.py), frontend (bench_frontend.py), checkpoint
# (bench_checkpoint.py), tokenize (bench_tokenize.py devices: needs .gpu_data/audio).
#
# Environment: OUT (default ./gpu_suite_out); PYTHON (python3); GPU_SUITE_DEADLINE_S, whole seconds from the
# start after which no section runs and the one running is stopped (default 470 on a GPU, 1200 with --smoke;
# each section also has its own limit, and 20 s are kept for the bundle); GPU_SUITE_LIMIT_S, a cap on every
# section's own limit (default none); GPU_SUITE_DATA, a tokenized dataset
# for loop (default .gpu_data/tokens, from benchmarks/gpu_prep.sh; a study's own, e.g.
# <study OUT>/work/default_corpus_tokens, does as well); GPU_SUITE_AUDIO and GPU_SUITE_WEIGHTS for tokenize.
# Carried wheels: .whl/*.whl are installed into /tmp/site first (gpu_prep.sh fetches datasets and the two
# packages it needs that the GPU image lacks).
#
# Files under $OUT (the device tool brings back 8 at most, 2 folders deep): tables.md (every section's table,
# appended as it ends, then the sections' status), results.json (every section's status and JSON rows),
# profile.txt, suite.log (all output, each section's wall time), env.txt, raw.tar.gz (each section's own files;
# the folder raw/ instead if the run was killed before the end). Exit status 1 if a section failed (not one
# stopped at the deadline), else 0.
set -u -o pipefail
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
T0=$SECONDS
DEADLINE=${GPU_SUITE_DEADLINE_S:-$([ $SMOKE = 1 ] && echo 1200 || echo 470)}
CAP=${GPU_SUITE_LIMIT_S:-}   # at most this many seconds for any one section (default: each its own limit)
for v in "GPU_SUITE_DEADLINE_S=$DEADLINE" "GPU_SUITE_LIMIT_S=$CAP"; do
  if ! [[ "${v#*=}" =~ ^[0-9]*$ ]]; then
    echo "error: ${v%%=*} must be whole seconds, got '${v#*=}'" >&2
    exit 2
  fi
done
RESERVE=20   # seconds kept for the bundle
SECTIONS=${GPU_SUITE_SECTIONS:-step peer compile loop runner}
FAILED=""
KNOWN=" step peer compile loop runner fp16_modes fp16_overflow frontend checkpoint tokenize "
for s in $SECTIONS; do
  [[ "$KNOWN" == *" $s "* ]] || { echo "error: GPU_SUITE_SECTIONS: unknown section '$s' (known:$KNOWN)" >&2; exit 2; }
done

OUT=${OUT:-$PWD/gpu_suite_out}
rm -rf "$OUT/raw" "$OUT/raw.tar.gz" "$OUT/results.json" "$OUT/profile.txt"
mkdir -p "$OUT/raw"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the package from this tree (not installed there)
LOG="$OUT/suite.log"
STATUS="$OUT/raw/status.jsonl"
: >"$LOG"
: >"$STATUS"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ $SMOKE = 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || echo "wheel install failed (see suite.log)" | tee -a "$LOG"
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# section NAME LIMIT_S OUTFILE CMD...: CMD under a time limit (its own, cut to what the deadline leaves), its
# stdout into raw/OUTFILE, the log and tables.md; its status into raw/status.jsonl. A failure or a stop at the
# limit is written there too and the suite goes on.
section() {
  local name=$1 limit=$2 outfile=$OUT/raw/$3
  shift 3
  local left=$((DEADLINE - RESERVE - (SECONDS - T0))) status rc=0 t=$SECONDS start
  if [ "$left" -lt 20 ]; then
    echo "SKIPPED $name: the suite's deadline (${DEADLINE} s) leaves ${left} s" | tee -a "$LOG" >"$outfile"
    status=skipped
    limit=0
  else
    [ $SMOKE = 1 ] && limit=600  # a shared CPU can be slow: the limits only guard against a hang there
    [ "$limit" -gt "$left" ] && limit=$left
    [ -n "$CAP" ] && [ "$limit" -gt "$CAP" ] && limit=$CAP
    start=$(date +%s)
    echo "=== $name (limit ${limit} s) ===" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" 2>>"$LOG" | tee -a "$LOG" >"$outfile"
    rc=${PIPESTATUS[0]}
    status=ok
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
      status=stopped
      echo "STOPPED $name at its limit of ${limit} s (the rows above are the finished ones); see suite.log" \
        | tee -a "$LOG" >>"$outfile"
    elif [ "$rc" != 0 ]; then
      status=failed
      FAILED="$FAILED $name"
      echo "FAILED $name: exit status $rc; see suite.log" | tee -a "$LOG" >>"$outfile"
    fi
    echo "=== $name: $((SECONDS - t)) s (suite so far $((SECONDS - T0)) s) ===" | tee -a "$LOG"
  fi
  printf '{"section": "%s", "status": "%s", "exit": %d, "limit_s": %d, "wall_s": %d, "started_unix": %s}\n' \
    "$name" "$status" "$rc" "$limit" "$((SECONDS - t))" "${start:-null}" >>"$STATUS"
  printf '\n## %s\n\n' "$name" >>"$OUT/tables.md"
  cat "$outfile" >>"$OUT/tables.md"
}

# skip NAME OUTFILE REASON
skip() {
  echo "SKIPPED $1: $3" | tee -a "$LOG" >"$OUT/raw/$2"
  printf '{"section": "%s", "status": "skipped", "exit": 0, "limit_s": 0, "wall_s": 0, "reason": "%s"}\n' \
    "$1" "$3" >>"$STATUS"
  printf '\n## %s\n\nSKIPPED: %s\n' "$1" "$3" >>"$OUT/tables.md"
}

# bundle: results.json (statuses and every JSON under raw/), the status table, raw/ into raw.tar.gz
bundle() {
  [ -n "${SAMPLER:-}" ] && kill "$SAMPLER" 2>/dev/null
  $PY - "$OUT" <<'PYEOF' >>"$LOG" 2>&1 || echo "results.json not written (see suite.log)" | tee -a "$LOG"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
raw = out / "raw"
status = [json.loads(line) for line in (raw / "status.jsonl").read_text().splitlines() if line.strip()]
data = {}
for path in sorted(raw.rglob("*.json")):
    try:
        data[str(path.relative_to(raw))] = json.loads(path.read_text())
    except ValueError as e:  # a file cut mid-write at the deadline: say so, keep the rest
        data[str(path.relative_to(raw))] = {"unreadable": str(e)}
env = (out / "env.txt").read_text() if (out / "env.txt").exists() else ""
(out / "results.json").write_text(json.dumps({"env": env, "sections": status, "files": data}, indent=1) + "\n")
with (out / "tables.md").open("a") as f:
    f.write("\n## sections\n\n| section | status | wall s | limit s |\n|---|---|---|---|\n")
    for s in status:
        f.write(f"| {s['section']} | {s['status']} | {s['wall_s']} | {s['limit_s']} |\n")
PYEOF
  tar -czf "$OUT/raw.tar.gz" -C "$OUT" raw && rm -rf "$OUT/raw"
  echo "suite done in $((SECONDS - T0)) s" | tee -a "$LOG"
}

DATA=${GPU_SUITE_DATA:-.gpu_data/tokens}
AUDIO=${GPU_SUITE_AUDIO:-.gpu_data/audio}
WEIGHTS=(${GPU_SUITE_WEIGHTS:+--weights "$GPU_SUITE_WEIGHTS"})
{
  date -u
  echo "smoke=$SMOKE data=$DATA deadline=${DEADLINE}s sections=$SECTIONS"
  if [ $SMOKE = 0 ]; then  # the versions (importing transformers alone takes seconds: not in the smoke run)
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
    $PY -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
    $PY -c "import datasets; print('datasets', datasets.__version__)" 2>&1 | tail -1
    nproc
  fi
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >>"$LOG"
printf '# gpu_suite.sh tables (%s)\n\n```\n%s\n```\n' "$(date -u +%FT%TZ)" "$(cat "$OUT/env.txt")" >"$OUT/tables.md"
if [ $SMOKE = 0 ] && command -v nvidia-smi >/dev/null; then  # GPU use over the whole run, once a second
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw,clocks.sm --format=csv -l 1 \
    >"$OUT/raw/gpu_use.csv" 2>/dev/null &
  SAMPLER=$!
fi

# Each section's command is the GPU plan's; with --smoke, the arguments after it (S) make it tiny and put it on
# the CPU: the last value of an option wins, so the smoke run also checks that every option of the GPU plan parses.
# No warm-up steps there (a smoke run times nothing; each is seconds of a test's CPU), except the runner's
# workers: their first step must not eat the 1 s window.
TMP=/tmp
S=()
TINY=()
if [ $SMOKE = 1 ]; then
  # one torch thread per process: on a shared CPU, threads spin-waiting for a core cost more than they give
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  TMP=${TMPDIR:-/tmp}
  TINY=(--batch 1 --seconds 0.64)
fi
smoke() { if [ $SMOKE = 1 ]; then S=("$@"); else S=(); fi; }

for s in $SECTIONS; do
  case $s in
  step)
    smoke --device cpu --sizes tiny --cases fairseq-math --extra tiny:fp32-sdpa+gemm "${TINY[@]}" --steps 1 --warmup 0 \
      --profile-steps 1
    section step 150 step.md $PY benchmarks/bench_gpu.py --sizes base large --cases fairseq-math fairseq-relax bf16-sdpa \
      --extra base:fairseq-math+gemm base:fairseq-math+cudnnbench large:fairseq-math+gemm --steps 10 --warmup 3 \
      --profile "$OUT/profile.txt" --json "$OUT/raw/step.json" "${S[@]}" ;;
  peer)
    smoke --device cpu --sizes tiny --cases fp32-sdpa "${TINY[@]}" --steps 1 --warmup 0
    section peer 100 peer.md $PY benchmarks/bench_gpu_peer.py --sizes base large --cases fairseq-math bf16-sdpa \
      --steps 6 --warmup 2 --json "$OUT/raw/peer.json" "${S[@]}" ;;
  compile)
    # as train.compile does, then per layer; the second also when the first failed; the worse exit status of the
    # two. Smoke: the eager backend (dynamo's tracing without inductor's code generation)
    smoke --device cpu --sizes tiny --cases fp32-sdpa "${TINY[@]}" --steps 1 --warmup 0 --compile-backend eager
    section compile 130 compile.md bash -c "$PY benchmarks/bench_gpu.py --sizes base --cases fairseq-math \
      --compile trainer --steps 10 --warmup 3 --json $OUT/raw/compile_trainer.json ${S[*]}; a=\$?; \
      $PY benchmarks/bench_gpu.py --sizes base --cases fairseq-math --compile layers --steps 10 --warmup 3 \
      --json $OUT/raw/compile_layers.json ${S[*]}; b=\$?; exit \$(( a > b ? a : b ))" ;;
  loop)
    smoke --device cpu --size tiny "${TINY[@]}" --workers 0 --steps 2 --log-every 1 --skip-rows 0 --synthetic-steps 1 \
      --synthetic-warmup 0
    if [ -d "$DATA" ]; then
      section loop 100 loop.md $PY benchmarks/bench_gpu_loop.py --data "$DATA" --steps 200 --log-every 10 \
        --skip-rows 3 --out "$OUT/raw/loop" "${S[@]}"
    else
      skip loop loop.md "no tokenized dataset at $DATA (benchmarks/gpu_prep.sh makes one; or set GPU_SUITE_DATA)"
    fi ;;
  runner)
    smoke --device cpu --size tiny --case fp32-sdpa "${TINY[@]}" --jobs 1 2 --inproc 2 --window 1 --lead 0 --warmup 1
    section runner 120 runner.md $PY benchmarks/bench_gpu_runner.py --jobs 1 3 5 7 --inproc 3 --window 12 --lead 2 \
      --json "$OUT/raw/runner.json" "${S[@]}" ;;
  fp16_modes)
    smoke --device cpu --size tiny --layers 1 --batch 1 --seconds 0.5 --rounds 1 --warmup 0
    section fp16_modes 120 fp16_modes.md bash -c "$PY benchmarks/bench_fp16.py --device cuda --size base --batch 16 \
      --seconds 5.12 --rounds 8 --json $OUT/raw/fp16_base.json ${S[*]} && $PY benchmarks/bench_fp16.py \
      --device cuda --size large --batch 8 --seconds 5.12 --rounds 8 --json $OUT/raw/fp16_large.json ${S[*]}" ;;
  fp16_overflow)
    smoke --device cpu --overlay recipes/overlays/tiny.yaml --steps 2 --recipes study_prenorm_attnrelax_clip1 \
      --set data.batch_size=1 data.crop_seconds=0.5 data.eval_fraction=0
    if [ -d "$DATA" ]; then
      section fp16_overflow 150 fp16_overflow.md $PY benchmarks/study_overflow.py --data "$DATA" --lr 1.5e-2 \
        --steps 200 --out "$TMP/gpu_suite_overflow_$$" "${S[@]}"
    else
      skip fp16_overflow fp16_overflow.md "no tokenized dataset at $DATA"
    fi ;;
  frontend)
    smoke --device cpu --conv-dim 16 --batch 1 --seconds 0.5 --dtypes fp32 --repeats 1
    section frontend 30 frontend.md $PY benchmarks/bench_frontend.py --device cuda --batch 64 --dtypes bf16 fp16 \
      --repeats 10 --json "$OUT/raw/frontend.json" "${S[@]}" ;;
  checkpoint)
    smoke --device cpu --sizes tiny --rounds 1
    section checkpoint 60 checkpoint.md $PY benchmarks/bench_checkpoint.py --device cuda --sizes large --rounds 2 \
      --dir "$TMP/gpu_suite_ckpt_$$" --json "$OUT/raw/checkpoint.json" "${S[@]}" ;;
  tokenize)
    smoke --tracks 1 --devices cpu cpu --workers 0
    if [ -d "$AUDIO" ]; then
      section tokenize 90 tokenize.md $PY benchmarks/bench_tokenize.py devices --audio "$AUDIO" --tracks 4 \
        --devices cpu cuda --work "$TMP/gpu_suite_tok_$$" "${WEIGHTS[@]}" "${S[@]}"
    else
      skip tokenize tokenize.md "no audio at $AUDIO (benchmarks/gpu_prep.sh ... 8 4 copies 4 tracks)"
    fi ;;
  esac
done
bundle
if [ -n "$FAILED" ]; then
  echo "failed sections:$FAILED" | tee -a "$LOG" >&2
  exit 1
fi
