"""``python -m musiclm_stab``: the ``musiclm-stab`` command, for an environment whose scripts are not on PATH."""

import sys

from musiclm_stab.cli import main

if __name__ == "__main__":
    sys.exit(main())
