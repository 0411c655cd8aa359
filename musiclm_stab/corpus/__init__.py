"""The default corpus of real music, rendered offline from music21's scores (see build.py).

    render.py    timed notes for General MIDI instruments -> audio through TimGM6mb.sf2 (sampler or tinysoundfont)
    soundfont.py reading a SoundFont 2 file: samples, and the zones a preset plays for a key and velocity
    sampler.py   the package's own sample player (the default renderer: numpy and scipy, nothing to install)
    chorales.py  Bach chorales voiced for four instruments (the default corpus)
    works.py     string quartets, madrigals, trecento, fiddle tunes (the ``hours`` preset)
    labels.py    exact labels of the rendered audio at 75 Hz: pitches per frame, key, instruments, tempo
    build.py     a corpus folder: audio files, manifest.jsonl, labels, corpus.json (musiclm-stab build-corpus)
"""
