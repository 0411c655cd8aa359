#!/usr/bin/env bash
# Fetch, where pip can reach a package index, the wheels that benchmarks/study_gpu.sh installs on a GPU
# machine without one: the project's dependencies that the machine's image (Python 3.12, torch,
# torchaudio, accelerate, numpy, scipy, pandas, pyarrow, matplotlib, tensorboard, numba, ...) lacks, at
# the versions this repository's venv runs. Into .whl/ at the repository root (keep it out of git:
# `echo /.whl/ >> .git/info/exclude`), to be carried with the working tree; about 40 MB.
#
#   bash benchmarks/study_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# name==version: the venv's versions (`pip list` here). torch/torchaudio are the image's own.
PACKAGES=(encodec==0.1.1 librosa==0.11.0 soundfile==0.14.0 audioread==3.1.0 soxr==1.1.0 pooch==1.9.0
          decorator==5.3.1 cffi==2.1.1 pycparser==3.12 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
          music21==10.5.1 chardet==7.7.0 jsonpickle==4.1.4 more-itertools==11.2.1 webcolors==25.10.0
          pretty_midi==0.2.11.post0 importlib_resources==7.1.0 mido==1.3.3 tinysoundfont==0.3.7
          platformdirs==4.14.9)  # importlib_resources: pretty_midi imports it; the image lacks it (seen there)
for pkg in "${PACKAGES[@]}"; do
    # A package published only as source (encodec 0.1.1 is pure Python) comes as its sdist; study_gpu.sh
    # installs it without build isolation (setuptools is in the image).
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d .whl "$pkg" 2>/dev/null || python3 -m pip download -q --no-deps --no-binary=:all: -d .whl "$pkg"
done
du -sh .whl
