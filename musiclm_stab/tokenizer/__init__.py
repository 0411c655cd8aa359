"""The tokenizer: audio -> EnCodec codes, saved as an HF dataset (``musiclm-stab tokenize``).

    pipeline.py  the job: plan, resume, run the units, finalize
    cli.py       the command line (musiclm-stab tokenize, --merge)
    sources.py   where the tracks come from (folder, manifest, HF dataset, stream) and opening one
    plan.py      the work units: consecutive tracks, long tracks cut into pieces
    units.py     one unit: check, segment, encode and write its tracks' rows into a part file
    policy.py    which readable tracks are used (silence, length); the settings rows depend on
    segments.py  the segment grid, cutting segments from blocks, a piece read from mid-file
    encode.py    EnCodec encoding of a batch, in full fp32 (TF32 off)
    workers.py   units in worker processes, committed as they finish
    store.py     the output folder being written: resume state, finalizing, the verdict on long tracks
    lock.py      one writer per output folder
    merge.py     merging shard outputs
    weights.py   loading EnCodec (pretrained or local weights) and the weights' identity
    fit.py       making local weights (``musiclm-stab make-weights``); kmeans.py its k-means

The read side of the format is musiclm_stab/data/tokenized.py (``load_tokenized``).
"""
