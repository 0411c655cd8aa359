"""Pretraining entry point.

    accelerate launch recipes/pretrain.py --config recipes/tiny.yaml [--config OVERLAY.yaml] [--section.key=value ...] [--resume]
    accelerate launch -m musiclm_stab.recipes.pretrain --config ...    # the same, from an installed package

The loop lives in musiclm_stab/training/trainer.py; this file only makes it launchable by path. It lives in the
package with the recipes (musiclm_stab/recipes/, package data), so an installed wheel has it; a checkout's
recipes/ is a symlink to this folder.
"""

import sys

from musiclm_stab.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
