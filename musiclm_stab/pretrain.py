"""Pretraining entry point: the trainer that ``musiclm-stab train`` launches.

    musiclm-stab train [ACCELERATE OPTIONS --] --config tiny [--config overlays/tiny] [--section.key=value ...]
    accelerate launch [ACCELERATE OPTIONS] -m musiclm_stab.pretrain --config tiny ...   # the same

The loop lives in musiclm_stab/training/trainer.py, its arguments in training/arguments.py; this module only
makes it launchable. It is not under musiclm_stab/recipes/ (where a checkout's ``recipes/pretrain.py`` is, to be
launched by path): importing a module of that folder would make ``musiclm_stab.recipes`` the folder instead of
the API's ``recipes()``.
"""

import sys

from musiclm_stab.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
