#!/usr/bin/env bash
# The GPU study in one sitting: data preparation (render the default corpus, local EnCodec weights,
# tokenize), the four study configurations at base size in fp16 (recipes/overlays/study_gpu.yaml), the
# figures and the claims table; one archive of the results. Meant for one CUDA GPU with nothing to
# download: the packages the machine lacks travel as wheels in .whl/ (benchmarks/study_gpu_wheels.sh
# fetches them where pip works; about 40 MB), the soundfont in pretty_midi's wheel.
#
#   bash benchmarks/study_gpu.sh OUT [musiclm-stab study options ...]
#
# OUT gets study_gpu.tar.gz (figures, claims.md/json, summary.json, timing.json, the codes record data.json,
# every run's config.yaml, metrics.jsonl, tokenizer.json, study_time.json and probe/probe.json: what the study needs
# to read the runs again elsewhere) and study_gpu.log (everything printed, with the time of each stage). Options after
# OUT go to `musiclm-stab study --scale gpu` (e.g. --steps 600 --seeds 2 --jobs 2, or --data TOKENS to skip
# the data preparation). Environment: PYTHON (default python3); STUDY_ALLOW_CPU=1 runs without a GPU
# (the test suite runs this script at tiny size on CPU that way); STUDY_GPU_WHEELS, the folder of carried
# wheels (default .whl; empty: install none, use the environment's packages, as the test does);
# STUDY_GPU_DEADLINE_S, whole seconds from the script's start after which the study and its runs are sent
# SIGTERM (each run checkpoints and stops after its current step; the script waits for them up to 90 s, so
# allow ~2 min past the deadline with the archive) and what was written is archived all the same: for a
# lease shorter than the study (default: none). Rerunning the same command resumes the runs.
set -euo pipefail
OUT=${1:?usage: bash benchmarks/study_gpu.sh OUT [study options ...]}
shift
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/study_gpu.log"
cd "$REPO"

stamp() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
: >"$LOG"
START=$(date +%s)
WHEELS=${STUDY_GPU_WHEELS-.whl}
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ] && compgen -G "$WHEELS/*" >/dev/null; then
    stamp "installing $(ls "$WHEELS" | wc -l) carried packages from $WHEELS into /tmp/site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# accelerate's launcher beside this Python, else on PATH; the study finds it the same way.
"$PYTHON" - <<'EOF' 2>&1 | tee -a "$LOG"
import os, torch
gpu = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {'yes: ' + torch.cuda.get_device_name(0) if gpu else 'no'}")
if not gpu and os.environ.get("STUDY_ALLOW_CPU") != "1":
    raise SystemExit("no CUDA GPU: the gpu scale trains in fp16 (set STUDY_ALLOW_CPU=1 with a CPU override to test)")
EOF

stamp "study: $PYTHON -m musiclm_stab.cli study --scale gpu --work $OUT/work --runs $OUT/runs $*"
LIMIT=()
if [ -n "${STUDY_GPU_DEADLINE_S:-}" ]; then
    [[ "$STUDY_GPU_DEADLINE_S" =~ ^[0-9]+$ ]] || { stamp "STUDY_GPU_DEADLINE_S must be whole seconds, got '$STUDY_GPU_DEADLINE_S'"; exit 2; }
    # timeout signals its own process group: the study and every run it launched
    LEFT=$(( STUDY_GPU_DEADLINE_S - ($(date +%s) - START) ))
    LIMIT=(timeout --kill-after=15 "$(( LEFT > 1 ? LEFT : 1 ))")  # (timeout 0 would mean no limit)
fi
set +e
"${LIMIT[@]}" "$PYTHON" -m musiclm_stab.cli study --scale gpu --work "$OUT/work" --runs "$OUT/runs" "$@" 2>&1 | tee -a "$LOG"
STATUS=${PIPESTATUS[0]}
set -e
if [ ${#LIMIT[@]} -gt 0 ] && { [ "$STATUS" = 124 ] || [ "$STATUS" = 137 ]; }; then
    # each run, signalled too, checkpoints and stops after its current step: wait for them (at most 90 s)
    for _ in $(seq 90); do pgrep -f -- "--train.output_dir=$OUT/runs" >/dev/null || break; sleep 1; done
    stamp "study stopped at the deadline of ${STUDY_GPU_DEADLINE_S} s (exit $STATUS): unfinished runs hold their metrics so far"
fi
stamp "study exited with $STATUS after $(( $(date +%s) - START )) s"

# One archive (the device tool returns few files): figures, tables, and each run's config and metrics.
# The study's folder, as `study` names it: --name, else by --design and --arm (study_plan.default_name)
STUDY_DIR="$OUT/runs/$("$PYTHON" -c 'import sys
from musiclm_stab.experiments.study_plan import default_name
a = sys.argv[1:]
def opt(name, default):
    for i, x in enumerate(a):
        if x == name and i + 1 < len(a):
            return a[i + 1]
        if x.startswith(name + "="):
            return x.split("=", 1)[1]
    return default
print(opt("--name", default_name("gpu", opt("--design", "claims"), opt("--arm", "schemes"))))' "$@")"
# probe/probe.json, not probe/cache/: features of every layer, gigabytes at base size
KEPT=$(cd "$STUDY_DIR" 2>/dev/null && ls -d figures */config.yaml */metrics.jsonl */tokenizer.json */study_time.json \
    */probe/probe.json data.json logs 2>/dev/null || true)
if [ -n "$KEPT" ]; then
    (cd "$STUDY_DIR" && tar -czf "$OUT/study_gpu.tar.gz" --exclude='*.pdf' $KEPT)
    stamp "results: $OUT/study_gpu.tar.gz ($(du -h "$OUT/study_gpu.tar.gz" | cut -f1))"
else
    stamp "nothing to archive: the study wrote nothing under $STUDY_DIR"
fi
exit "$STATUS"
