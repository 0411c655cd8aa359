"""Peak memory (RSS) of chunked feature extraction at base size on CPU, for inputs of several lengths.

    .venv/bin/python benchmarks/bench_features.py --minutes 2 10 [--modes disk memory] [--agreement-seconds 60]

Each (length, mode) runs in a fresh subprocess, so every peak is its own: ``ru_maxrss`` of the child,
which includes the Python interpreter, torch and the model (reported separately as ``baseline``, the RSS
after loading the model). Modes:

- ``disk``: batch mode (``extract_folder``), all 13 hidden states written to .npy chunk by chunk;
  nothing grows with the length but the audio itself (10 min at 24 kHz: 58 MB).
- ``memory``: ``extract_features`` of the last layer, kept in memory ([T, 768] fp32: 138 MB for 10 min).

Input: Bach chorales rendered offline with the corpus builder, concatenated to the length (real music;
synthetic tones when the corpus packages are missing), decoded from a 16-bit WAV file. The model is a
base-size MusicMLM with random weights (memory does not depend on the weights). With
``--agreement-seconds`` the chunked features (default 30 s windows, 10 s overlap) are compared with one
whole pass on a clip of that length, per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SR = 24_000


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def make_audio(path: Path, seconds: float) -> str:
    """Write ``seconds`` of music to a 16-bit mono WAV at 24 kHz; returns a description of the source."""
    import soundfile as sf

    n = int(seconds * SR)
    with sf.SoundFile(path, "w", SR, 1, "PCM_16") as f:
        try:
            from musiclm_stab.corpus import chorales, render

            written, names = 0, []
            for source in chorales.chorale_sources():
                if written >= n:
                    break
                try:
                    track = chorales.plan_track(source, seed=0, ensemble="string quartet")
                except Exception:  # a few scores cannot be voiced: the corpus builder skips them too
                    continue
                audio = render.render_track(track, SR).mean(axis=1)[: n - written]
                f.write(audio)
                written += len(audio)
                names.append(Path(source).stem)
            return f"{len(names)} Bach chorale(s) rendered and concatenated ({', '.join(names[:3])}, ...)"
        except ImportError:
            t = np.arange(n) / SR
            f.write((0.3 * np.sin(2 * np.pi * 220 * t) * np.exp(-(t % 0.5) / 0.2)).astype(np.float32))
            return "synthetic decaying tones"


def make_run(root: Path) -> Path:
    """A base-size run directory with one checkpoint of random weights."""
    import torch
    from safetensors.torch import save_file

    from musiclm_stab.config import Config, save_config
    from musiclm_stab.model import MusicMLM

    cfg = Config()
    cfg.model.size = "base"
    cfg.validate()
    torch.manual_seed(0)
    model = MusicMLM(cfg.model)
    ckpt = root / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    save_config(cfg, root / "config.yaml")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "consumed_micro_batches": 1}))
    return root


def child(args: argparse.Namespace) -> None:
    import torch

    from musiclm_stab.export.feature_files import extract_folder
    from musiclm_stab.export.features import extract_features, load_feature_model

    model = load_feature_model(args.run, "cpu")
    baseline = rss_mb()
    t0 = time.perf_counter()
    if args.child == "disk":
        summary = extract_folder(model, args.audio, args.out, None, args.chunk_seconds, progress=False)
        frames = summary.written[0]["frames"]
        layers = model.num_layers + 1
    else:
        feats = extract_features(args.audio, model, [-1], args.chunk_seconds)
        frames, layers = feats.layers[model.num_layers].shape[0], 1
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "mode": args.child,
                "frames": frames,
                "layers": layers,
                "baseline_mb": round(baseline),
                "peak_mb": round(peak_rss_mb()),
                "wall_s": round(seconds, 1),
                "x_realtime": round(frames / 75 / seconds, 2),
                "threads": torch.get_num_threads(),
            }
        )
    )


def agreement(args: argparse.Namespace) -> None:
    from musiclm_stab.export.features import chunking_error, load_feature_model

    model = load_feature_model(args.run, "cpu")
    for global_stats in (True, False):
        err = chunking_error(args.audio, model, None, args.chunk_seconds, global_stats=global_stats)
        for layer, e in err.items():
            print(
                json.dumps(
                    {
                        "global_stats": global_stats,
                        "layer": layer,
                        "rel_err": round(e.rel_err, 4),
                        "max_abs": round(e.max_abs, 4),
                        "min_cos": round(e.min_cos, 4),
                        "mean_cos": round(e.mean_cos, 5),
                    }
                ),
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, nargs="*", default=[2, 10], help="input lengths; none: skip")
    p.add_argument("--modes", nargs="+", default=["disk", "memory"], choices=["disk", "memory"])
    p.add_argument("--chunk-seconds", type=float, default=30.0)
    p.add_argument("--agreement-seconds", type=float, default=0.0, help="0: skip the chunked-vs-whole check")
    p.add_argument("--child", choices=["disk", "memory", "agreement"], help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--audio", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "agreement":
        return agreement(args)
    if args.child:
        return child(args)

    with tempfile.TemporaryDirectory(prefix="bench_features_") as tmp:
        tmp = Path(tmp)
        run = make_run(tmp / "run")
        print(
            f"base model (random weights) in {run}; chunk {args.chunk_seconds} s, overlap a third", flush=True
        )
        me = [
            sys.executable,
            os.path.abspath(__file__),
            "--run",
            str(run),
            "--chunk-seconds",
            str(args.chunk_seconds),
        ]
        for minutes in args.minutes:
            audio = tmp / f"music_{minutes:g}min.wav"
            print(f"{minutes:g} min: {make_audio(audio, minutes * 60)}", flush=True)
            for mode in args.modes:
                out = subprocess.run(
                    [*me, "--child", mode, "--audio", str(audio), "--out", str(tmp / f"out_{mode}")],
                    capture_output=True,
                    text=True,
                )
                if out.returncode:
                    sys.exit(f"child failed:\n{out.stderr}")
                print(
                    json.dumps({"minutes": minutes, **json.loads(out.stdout.strip().splitlines()[-1])}),
                    flush=True,
                )
        if args.agreement_seconds:
            audio = tmp / "agreement.wav"
            make_audio(audio, args.agreement_seconds)
            print(
                f"chunked ({args.chunk_seconds} s windows) vs whole pass on {args.agreement_seconds:g} s:",
                flush=True,
            )
            subprocess.run([*me, "--child", "agreement", "--audio", str(audio)], check=True)


if __name__ == "__main__":
    main()
