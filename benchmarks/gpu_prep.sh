#!/usr/bin/env bash
# Run HERE (a machine with a package registry and a tokenized corpus) before benchmarks/gpu_suite.sh goes
# to the GPU machine, which lacks `datasets` and any tokens. Writes two git-ignored folders of this tree:
#   .whl/             the wheels the real loop needs there: datasets and its two dependencies the GPU image
#                     lacks (dill, multiprocess); everything else datasets needs is in that image
#   .gpu_data/tokens  the first ROWS rows of a real tokenized dataset (made by musiclm-stab tokenize with the
#                     real EnCodec tokenizer; default work/default_corpus_tokens), with its tokenizer.json
#   .gpu_data/audio   the first TRACKS audio files of the default corpus (work/default_corpus, ~4 MB each),
#                     for the tokenizer's CPU-vs-GPU section; with them the wheels the tokenizer needs there
#                     (encodec, built here: it has no wheel on PyPI; soundfile, cffi, pycparser)
#
# datasets 5.2 needs pyarrow >= 24: if the GPU machine's pyarrow is older (gpu_suite.sh writes its version
# into env.txt), WITH_PYARROW=1 adds this venv's pyarrow wheel (~40 MB of the 64 MiB a call may carry; the
# defaults' tokens and audio take ~37 MB, so then pass ROWS 8 and TRACKS 1).
#
#   bash benchmarks/gpu_prep.sh [TOKENIZED_DATASET] [ROWS] [TRACKS]
# then call the device tool with carry [".whl", ".gpu_data"] and `bash benchmarks/gpu_suite.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-work/default_corpus_tokens}
ROWS=${2:-24}
TRACKS=${3:-4}
AUDIO_SRC=${GPU_PREP_AUDIO:-work/default_corpus}
PY=${PYTHON:-.venv/bin/python}
for d in /.whl/ /.gpu_data/; do grep -qxF "$d" .git/info/exclude || echo "$d" >>.git/info/exclude; done
rm -rf .whl && mkdir -p .whl
# The versions this project's venv has (tested with); cp312 manylinux, as the GPU machine's Python 3.12.
for spec in "datasets==$($PY -c 'import datasets; print(datasets.__version__)')" \
            "dill==$($PY -c 'import dill; print(dill.__version__)')" \
            "multiprocess==$($PY -c 'import multiprocess; print(multiprocess.__version__)')" \
            "soundfile==$($PY -c 'import soundfile; print(soundfile.__version__)')" \
            "cffi==$($PY -c 'import cffi; print(cffi.__version__)')" \
            "pycparser==$($PY -c 'import pycparser; print(pycparser.__version__)')" \
            ${WITH_PYARROW:+"pyarrow==$($PY -c 'import pyarrow; print(pyarrow.__version__)')"}; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$spec"
done
$PY -m pip wheel -q --no-deps -w .whl "encodec==$($PY -c 'import encodec; print(encodec.__version__)')"  # pure Python
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
mkdir -p .gpu_data/audio
find "$AUDIO_SRC" -maxdepth 1 -name '*.flac' | sort | head -n "$TRACKS" | xargs -r -I{} cp {} .gpu_data/audio/
echo ".gpu_data/audio: $(ls .gpu_data/audio | wc -l) tracks of $AUDIO_SRC"
du -sh .whl .gpu_data
