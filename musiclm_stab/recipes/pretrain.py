"""Pretraining entry point.

    accelerate launch recipes/pretrain.py --config recipes/tiny.yaml [--config OVERLAY.yaml] [--section.key=value ...] [--resume]

The loop lives in musiclm_stab/training/trainer.py; this file only makes it launchable by path.
"""

import sys

from musiclm_stab.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
