"""Tokenizer benchmarks on real music (the default corpus): throughput against the naive per-file loop,
peak memory against track length, and codes near segment boundaries against a whole-track encode.

    .venv/bin/python benchmarks/bench_tokenize.py throughput --work /tmp/bench_tok --weights W --tracks 8 --repeats 2
    .venv/bin/python benchmarks/bench_tokenize.py memory --work /tmp/bench_tok --weights W --minutes 1 60
    .venv/bin/python benchmarks/bench_tokenize.py boundary --work /tmp/bench_tok --weights W --tracks 24

throughput: ``musiclm-stab tokenize`` (defaults: one worker process per core, batches of 8 segments)
against the loop of the public implementation: one file at a time, decode it whole, ``convert_audio``
(down-mix + ``torchaudio.transforms.Resample``), ``model.encode`` of the whole track, torch's default
threads. Both run as fresh processes, end to end (imports, model load, writing output for ours), on
the same files, alternating, so load from other jobs hits both alike.
memory: a 1-minute and a 60-minute track (corpus tracks concatenated, 44.1 kHz stereo FLAC) each
tokenized by a fresh ``musiclm-stab tokenize`` process; its peak resident memory as the kernel counts
it (the largest process of the run; a single track runs in one process), and the sum over the process
and its children sampled every 0.1 s (which can miss a short peak). The peak is set by the encoder's activations for one batch
(``--batch-size`` segments of 10 s), so compare tracks long enough to fill a batch (a 1-minute track
has 6 segments: use ``--batch-size`` 6 or less, or compare 2 minutes with 60). ``--naive-minutes`` runs the naive
whole-track encode on tracks of those lengths for comparison (it grows with length: keep them short).
boundary: every 10 s segment encoded alone vs the whole track encoded at once: the fraction of equal
codes per codebook by position within the segment (segments after the first of each track).
``--weights`` defaults to local weights fitted on the corpus (the pretrained model needs internet);
the throughput and memory numbers do not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import soundfile as sf

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "musiclm_stab.cli"]


def corpus(work: Path, tracks: int) -> list[Path]:
    from musiclm_stab.corpus import build_corpus

    return build_corpus(work / "corpus", num_tracks=max(tracks, 24), seed=0, progress=False)[:tracks]


def weights_file(work: Path, files: list[Path], given: str | None) -> str:
    if given:
        return given
    path = work / "encodec_local_seed0.th"
    if not path.exists():
        from musiclm_stab.encodec_weights import make_local_weights

        make_local_weights(files, path, seed=0, max_seconds=600, progress=False)
    return str(path)


def run_measured(cmd: list[str]) -> dict:
    """Run a command; wall time, CPU time of it and its children, their peak RSS (sampled), load average."""
    load = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # through a fresh wrapper process, whose children's high-water mark is then this command's alone
    proc = subprocess.Popen([sys.executable, __file__, "maxrss-child", *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak = 0
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            rss = sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)])
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    output = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    maxrss_kb = int(output.rstrip().splitlines()[-1].split()[-1])  # the wrapper's last line
    return {"wall_s": wall, "cpu_s": cpu, "peak_tree_rss_mb": peak / 2**20, "peak_process_rss_mb": maxrss_kb / 1024,
            "load_before": load, "output": output}


def maxrss_child(cmd: list[str]) -> None:
    """Run ``cmd`` and print the largest peak RSS (KiB, the kernel's count) of it or any of its children."""
    code = subprocess.run(cmd).returncode
    print(f"MAXRSS_KB {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}", flush=True)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------------


def naive_child(weights: str, files: list[str]) -> None:
    """The public implementation's loop: whole file, convert_audio, encode the whole track."""
    import torch
    from encodec.utils import convert_audio

    from musiclm_stab.encodec_weights import load_encodec

    model, _ = load_encodec(weights)
    seconds = 0.0
    for f in files:
        data, sr = sf.read(f, dtype="float32", always_2d=True)  # (S, C)
        wav = convert_audio(torch.from_numpy(data.T.copy()), sr, model.sample_rate, model.channels)  # (1, S)
        with torch.no_grad():
            codes = model.encode(wav.unsqueeze(0))[0][0]  # (1, K, T)
        seconds += wav.shape[-1] / model.sample_rate
        assert codes.shape[1] == 8
    print(json.dumps({"seconds": seconds}))


def throughput(args, work: Path) -> dict:
    files = corpus(work, args.tracks)
    weights = weights_file(work, files, args.weights)
    subset = work / f"subset_{args.tracks}"
    if not subset.exists():
        subset.mkdir()
        for f in files:
            (subset / f.name).symlink_to(f)
    audio_s = sum(sf.info(f).duration for f in files)
    runs, cpu = {"ours": [], "naive": []}, {"ours": [], "naive": []}
    for rep in range(args.repeats):
        for name in ("naive", "ours") if rep % 2 == 0 else ("ours", "naive"):
            out = work / "tokens_ours"
            shutil.rmtree(out, ignore_errors=True)
            if name == "ours":
                cmd = [*CLI, "tokenize", str(subset), str(out), "--weights", weights, "--no-progress"]
            else:
                cmd = [sys.executable, __file__, "naive-child", *map(str, files), "--weights", weights]
            r = run_measured(cmd)
            runs[name].append(audio_s / r["wall_s"])
            cpu[name].append(r["cpu_s"])
            print(f"repeat {rep}: {name:5s} {r['wall_s']:7.1f} s for {audio_s:.0f} s of audio = "
                  f"{audio_s / r['wall_s']:.2f}x real time; CPU {r['cpu_s']:.0f} s "
                  f"({r['cpu_s'] / audio_s:.3f} CPU-s per audio-s); peak RSS {r['peak_tree_rss_mb']:.0f} MB; "
                  f"load average before {r['load_before']:.1f}", flush=True)
    result = {"audio_seconds": audio_s, "tracks": len(files), "cpus": os.cpu_count(),
              "ours_x_realtime": runs["ours"], "naive_x_realtime": runs["naive"],
              "ratio_per_repeat": [o / n for o, n in zip(runs["ours"], runs["naive"])],
              "ours_cpu_s": cpu["ours"], "naive_cpu_s": cpu["naive"]}
    print(json.dumps(result))
    return result


# ---------------------------------------------------------------------------------------------------


def long_track(files: list[Path], minutes: float, path: Path) -> Path:
    """Concatenate corpus tracks (cycling) into one 44.1 kHz stereo FLAC of ``minutes``, block by block."""
    if path.exists():
        return path
    info = sf.info(files[0])
    total, written = int(minutes * 60 * info.samplerate), 0
    tmp = path.with_name(path.name + ".partial")
    with sf.SoundFile(tmp, "w", info.samplerate, info.channels, format="FLAC", subtype="PCM_16") as out:
        i = 0
        while written < total:
            for block in sf.blocks(str(files[i % len(files)]), blocksize=2**16, dtype="float32", always_2d=True):
                block = block[: total - written]
                out.write(block)
                written += len(block)
                if written >= total:
                    break
            i += 1
    tmp.rename(path)
    return path


def memory(args, work: Path) -> dict:
    files = corpus(work, 24)
    weights = weights_file(work, files, args.weights)
    results = {}
    for minutes in args.minutes:
        folder = work / f"long_{minutes:g}min"
        folder.mkdir(exist_ok=True)
        track = long_track(files, minutes, folder / f"track_{minutes:g}min.flac")
        out = work / f"tokens_long_{minutes:g}min"
        shutil.rmtree(out, ignore_errors=True)
        r = run_measured([*CLI, "tokenize", str(folder), str(out), "--weights", weights, "--no-progress",
                          "--batch-size", str(args.batch_size)])
        line = [x for x in r["output"].splitlines() if x.startswith("tokenized")]
        results[f"ours_{minutes:g}min"] = {k: r[k] for k in ("wall_s", "peak_process_rss_mb", "peak_tree_rss_mb")}
        print(f"ours  {minutes:5g} min track, --batch-size {args.batch_size}: peak RSS {r['peak_process_rss_mb']:.0f} MB "
              f"(sampled, process tree: {r['peak_tree_rss_mb']:.0f} MB), {r['wall_s']:.0f} s "
              f"({minutes * 60 / r['wall_s']:.2f}x real time); {line[0] if line else ''}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    for minutes in args.naive_minutes:
        folder = work / f"long_{minutes:g}min"
        folder.mkdir(exist_ok=True)
        track = long_track(files, minutes, folder / f"track_{minutes:g}min.flac")
        r = run_measured([sys.executable, __file__, "naive-child", str(track), "--weights", weights])
        results[f"naive_{minutes:g}min"] = {k: r[k] for k in ("wall_s", "peak_process_rss_mb", "peak_tree_rss_mb")}
        print(f"naive {minutes:5g} min track: peak RSS {r['peak_process_rss_mb']:.0f} MB, {r['wall_s']:.0f} s", flush=True)
    print(json.dumps(results))
    return results


# ---------------------------------------------------------------------------------------------------


def boundary(args, work: Path) -> dict:
    """Equal codes, per codebook and position in a segment, between per-segment and whole-track encodes."""
    import torch

    from musiclm_stab.audio import load_audio
    from musiclm_stab.encodec_weights import load_encodec, one_thread, prepare_for_inference

    files = corpus(work, args.tracks)
    model, info = load_encodec(weights_file(work, files, args.weights))
    prepare_for_inference(model)
    seg = 750  # frames of a 10 s segment
    same, count, first_seg = np.zeros((8, seg)), 0, np.zeros((8, seg))
    with one_thread(), torch.inference_mode():
        for f in files:
            wave = load_audio(f)
            n_seg = len(wave) // (seg * 320)
            if n_seg < 2:
                continue
            wave = wave[: n_seg * seg * 320]
            whole = model.encode(wave.view(1, 1, -1))[0][0][0]  # (K, T)
            parts = torch.cat([model.encode(wave[i * seg * 320 : (i + 1) * seg * 320].view(1, 1, -1))[0][0][0]
                               for i in range(n_seg)], dim=1)  # (K, T)
            eq = (whole == parts).numpy().reshape(8, n_seg, seg)
            same += eq[:, 1:].sum(axis=1)
            first_seg += eq[:, 0]
            count += n_seg - 1
    same /= count
    first_seg /= len(files)
    bins = [("frame 0", 0, 1), ("frames 1-9 (to 0.13 s)", 1, 10), ("frames 10-37 (to 0.5 s)", 10, 38),
            ("frames 38-74 (0.5-1 s)", 38, 75), ("frames 75-374 (1-5 s)", 75, 375),
            ("frames 375-674 (5-9 s)", 375, 675), ("frames 675-749 (last 1 s)", 675, 750)]
    table = {name: [round(float(v), 4) for v in same[:, a:b].mean(axis=1)] for name, a, b in bins}
    print(f"{count} segment boundaries in {len(files)} tracks; weights {info['weights']} "
          f"{info['weights_sha256'][:12]}")
    print("| position in the segment | " + " | ".join(f"cb{k}" for k in range(8)) + " |")
    print("|---|" + "---|" * 8)
    for name, vals in table.items():
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    print("| first segment of each track, all frames (no boundary) | "
          + " | ".join(f"{v:.3f}" for v in first_seg.mean(axis=1)) + " |")
    return {"boundaries": count, "table": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["throughput", "memory", "boundary", "naive-child", "maxrss-child"])
    p.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--work", default="/tmp/bench_tokenize")
    p.add_argument("--weights", default=None)
    p.add_argument("--tracks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--minutes", type=float, nargs="+", default=[1, 60])
    p.add_argument("--naive-minutes", type=float, nargs="*", default=[])
    p.add_argument("--batch-size", type=int, default=8, help="memory: the tokenizer's --batch-size")
    if sys.argv[1:2] == ["maxrss-child"]:
        maxrss_child(sys.argv[2:])
    args = p.parse_args()
    if args.what == "naive-child":
        naive_child(args.weights, args.files)
        return
    work = Path(args.work).resolve()  # the subset folder links to corpus files by absolute path
    work.mkdir(parents=True, exist_ok=True)
    {"throughput": throughput, "memory": memory, "boundary": boundary}[args.what](args, work)


if __name__ == "__main__":
    main()
