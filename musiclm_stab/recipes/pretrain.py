"""Pretraining entry point: the trainer that ``musiclm-stab train`` launches.

    musiclm-stab train [ACCELERATE OPTIONS --] --config tiny [--config overlays/tiny] [--section.key=value ...]
    accelerate launch [ACCELERATE OPTIONS] -m musiclm_stab.recipes.pretrain --config tiny ...   # the same

The loop lives in musiclm_stab/training/trainer.py, its arguments in training/arguments.py; this file only
makes it launchable, as a module or by path. It lives in the package with the recipes (musiclm_stab/recipes/,
package data), so an installed wheel has it; a checkout's recipes/ is a symlink to this folder.
"""

import sys

from musiclm_stab.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
