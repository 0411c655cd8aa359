"""Pretraining entry point.

    accelerate launch recipes/pretrain.py --config recipes/tiny.yaml [--section.key=value ...] [--resume]

The loop lives in musiclm_stab/train.py; this file only makes it launchable by path.
"""

import sys

from musiclm_stab.train import main

if __name__ == "__main__":
    sys.exit(main())
