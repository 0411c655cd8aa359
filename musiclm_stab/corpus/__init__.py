"""The default corpus of real music, rendered offline from music21's scores (see build.py).

    render.py    timed notes for General MIDI instruments -> audio (tinysoundfont, TimGM6mb.sf2)
    chorales.py  Bach chorales voiced for four instruments (the default corpus)
    works.py     string quartets, madrigals, trecento, fiddle tunes (the ``hours`` preset)
    labels.py    exact labels of the rendered audio at 75 Hz: pitches per frame, key, instruments, tempo
    build.py     a corpus folder: audio files, manifest.jsonl, labels, corpus.json (musiclm-stab build-corpus)
"""
