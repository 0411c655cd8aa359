"""Build the default corpus: ``python data/build_default_corpus.py OUT_DIR [--num-tracks 24] [--seed 0] ...``

Same as ``musiclm-stab build-corpus``; see data/README.md for what it makes and the sources' licences.
"""

import sys

from musiclm_stab.corpus.build import cli_main

if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
