"""The trainer, launched by path from a checkout: ``accelerate launch recipes/pretrain.py --config tiny ...``
(a checkout's recipes/ is a symlink to this folder, which ships the packaged recipes).

Launched as a module it is ``-m musiclm_stab.pretrain`` (``musiclm-stab train`` runs that): the same
``training.trainer.main``. ``-m musiclm_stab.recipes.pretrain``, its earlier name,
still launches it.
"""

import sys

from musiclm_stab.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
