#!/usr/bin/env bash
# Run HERE (a machine with a package registry and a tokenized corpus) before benchmarks/gpu_suite.sh goes to the
# GPU machine, which lacks `datasets` and any tokens. Writes two git-ignored folders of this tree:
#   .whl/             the wheels the suite's loop section needs there: datasets and its two dependencies the GPU
#                     image lacks (dill, multiprocess), ~1 MB; other wheels already in .whl/ (the study's, from
#                     benchmarks/study_gpu_wheels.sh) stay, and another version of one of these is replaced, so
#                     that one install takes them all
#   .gpu_data/tokens  the first ROWS rows of a real tokenized dataset (made by musiclm-stab tokenize with the real
#                     EnCodec tokenizer; default work/default_corpus_tokens), with its tokenizer.json
#   .gpu_data/audio   only with TRACKS > 0 (the suite's optional tokenize section): the first TRACKS audio files of
#                     the default corpus (~4 MB each), and the wheels the tokenizer needs there (encodec, built
#                     here: it has no wheel on PyPI; soundfile, cffi, pycparser)
#
# Everything that travels to the GPU machine (the tracked tree, ~48 MB now, and the carried folders) must stay
# under the device tool's 64 MiB: the defaults add ~8 MB (8 rows of the default corpus: ~0.9 MB a row).
# datasets 5.2 needs pyarrow >= 24: if the GPU machine's were older, WITH_PYARROW=1 would add this venv's pyarrow
# wheel (~40 MB: too much beside the tree); the GPU study ran datasets there with the image's pyarrow.
#
#   bash benchmarks/gpu_prep.sh [TOKENIZED_DATASET] [ROWS] [TRACKS]
# then call the device tool with carry [".whl", ".gpu_data"] and `bash benchmarks/gpu_suite.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-work/default_corpus_tokens}
ROWS=${2:-8}
TRACKS=${3:-0}
AUDIO_SRC=${GPU_PREP_AUDIO:-work/default_corpus}
PY=${PYTHON:-.venv/bin/python}
[ -d "$SRC" ] || { echo "error: $SRC: no tokenized dataset there (musiclm-stab quickstart --data-only makes one)" >&2; exit 2; }
for d in .whl .gpu_data; do  # git-ignored (.gitignore has both), so that they travel only when carried
  git check-ignore -q "$d/x" || { mkdir -p .git/info && echo "/$d/" >>.git/info/exclude; }
done
mkdir -p .whl
version() { $PY -c "import $1; print($1.__version__)"; }
SPECS=("datasets==$(version datasets)" "dill==$(version dill)" "multiprocess==$(version multiprocess)")
if [ "$TRACKS" -gt 0 ]; then
  SPECS+=("soundfile==$(version soundfile)" "cffi==$(version cffi)" "pycparser==$(version pycparser)")
fi
[ -n "${WITH_PYARROW:-}" ] && SPECS+=("pyarrow==$(version pyarrow)")
# The versions this project's venv has (tested with); cp312 manylinux, as the GPU machine's Python 3.12.
for spec in "${SPECS[@]}"; do
  name=${spec%%==*} ver=${spec#*==}
  find .whl -maxdepth 1 -iname "${name}-*" ! -iname "${name}-${ver}-*" ! -iname "${name}-${ver}.tar.gz" -print -delete
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$spec"
done
if [ "$TRACKS" -gt 0 ]; then  # pure Python, source only on PyPI: built here
  find .whl -maxdepth 1 -iname "encodec-*" -delete
  $PY -m pip wheel -q --no-deps -w .whl "encodec==$(version encodec)"
fi
rm -rf .gpu_data && mkdir -p .gpu_data
$PY - "$SRC" "$ROWS" <<'PYEOF'
import shutil
import sys
from pathlib import Path

import datasets

src, rows = Path(sys.argv[1]), int(sys.argv[2])
ds = datasets.load_from_disk(str(src))
ds.select(range(min(rows, len(ds)))).save_to_disk(".gpu_data/tokens")
shutil.copy(src / "tokenizer.json", ".gpu_data/tokens/tokenizer.json")
print(f".gpu_data/tokens: {min(rows, len(ds))} of {len(ds)} rows of {src}")
PYEOF
if [ "$TRACKS" -gt 0 ]; then
  mkdir -p .gpu_data/audio
  find "$AUDIO_SRC" -maxdepth 1 -name '*.flac' | sort | head -n "$TRACKS" | xargs -r -I{} cp {} .gpu_data/audio/
  echo ".gpu_data/audio: $(ls .gpu_data/audio | wc -l) tracks of $AUDIO_SRC"
fi
du -sh .whl .gpu_data
echo "the tree that travels: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes tracked," \
  "+ $(du -sb .whl .gpu_data | awk '{s += $1} END {print s}') bytes carried (the limit: 67108864)"
