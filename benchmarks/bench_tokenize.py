"""Tokenizer benchmarks on real music (the default corpus): throughput against the naive per-file loop,
peak memory against track length, and codes near segment boundaries against a whole-track encode.

    .venv/bin/python benchmarks/bench_tokenize.py throughput --work /tmp/bench_tok --weights W --tracks 8 --repeats 2
    .venv/bin/python benchmarks/bench_tokenize.py memory --work /tmp/bench_tok --weights W --minutes 2 60 180
    .venv/bin/python benchmarks/bench_tokenize.py memory --work /tmp/bench_tok --weights W --minutes 2 10 --memory-repeats 4
    .venv/bin/python benchmarks/bench_tokenize.py boundary --work /tmp/bench_tok --weights W --tracks 24
    .venv/bin/python benchmarks/bench_tokenize.py workers --work /tmp/bench_tok --weights W --minutes 20
    .venv/bin/python benchmarks/bench_tokenize.py encode --work /tmp/bench_tok --weights W --tracks 4 --repeats 6
    .venv/bin/python benchmarks/bench_tokenize.py capability --work /tmp/bench_tok --weights W --tracks 4
    .venv/bin/python benchmarks/bench_tokenize.py devices --work /tmp/bench_tok --weights W --tracks 24   # GPU

throughput: ``musiclm-stab tokenize`` (defaults: one worker process per core, batches of 8 segments)
against the loop of the public implementation: one file at a time, decode it whole, ``convert_audio``
(down-mix + ``torchaudio.transforms.Resample``), ``model.encode`` of the whole track, torch's default
threads. Both run as fresh processes, end to end (imports, model load, writing output for ours), on
the same files, alternating, so load from other jobs hits both alike.
memory: one track per length in ``--minutes`` (corpus tracks concatenated, 44.1 kHz stereo FLAC, 16-bit),
each tokenized by a fresh ``musiclm-stab tokenize`` process with its defaults (one worker per core,
batches of 8 10-s segments, tracks of 10 minutes or more cut into 5-minute pieces that all workers
share); its peak resident memory as the kernel counts it (ru_maxrss: the largest single process of the
run, a worker), the sum over the process tree sampled every 0.1 s (which can miss a short peak), wall
time, real-time factor, CPU time, and from the unit records how many units there were and how many
worker processes encoded them, and the largest process's RSS at its highest in each tenth of the run (flat
when nothing grows with time) with which process that was (the tokenize command itself, "main", or a
"worker"). The peak is set by the encoder's activations (its convolutions run one
segment at a time, the LSTM on ``--batch-size`` segments) and by how the heap fragments in a worker's
first batches, which differs between identical runs: ``--memory-repeats N`` runs every length N times, in
rounds, to show that scatter. Compare tracks
long enough to fill a batch (a 1-minute track has 6 segments: compare 2 minutes with 60 and 180).
``--naive-minutes`` runs the naive whole-track encode on tracks of those
lengths for comparison (it grows with length: keep them short).
workers: one long track (``--minutes``, the first value) tokenized whole by one worker
(``--workers 1 --piece-seconds 0``: one unit, as before tracks were cut into pieces) and in pieces by
``--workers`` (default 2) workers: wall time of each, how many worker processes encoded units, and
whether the two outputs hold bit-identical rows (ids, starts, pcm, codes). ``--piece-seconds`` sets the
pieces' length (the default, 300 s in whole batches of 8 segments, cuts tracks of 640 s and more).
encode: the encoder alone, in one process as a tokenizer worker runs it (one thread, its allocator
setting): CPU time of ``encode_batch`` (convolutions one segment at a time, LSTM on the batch) against
``model.encode`` on the whole batch, on the 10 s segments of ``--tracks`` corpus tracks in batches of
``--batch-size``, alternating which goes first over ``--repeats`` rounds; and the fraction of equal codes.
capability: the same ``--tracks`` corpus tracks tokenized (fresh processes, the tokenizer's defaults) under
each ``ATEN_CPU_CAPABILITY`` of ``--capabilities`` (torch's CPU kernels for that instruction set; a value
the CPU lacks falls back to the best it has): the fraction of equal codes per codebook against the first.
devices: the same tracks tokenized with each ``--device`` of ``--devices`` (default cpu cuda): equal codes
per codebook against the first, and each run's real-time factor (a fresh process, end to end).
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


def corpus(work: Path, tracks: int, audio: str | None = None) -> list[Path]:
    """The first ``tracks`` of the default corpus (rendered into ``work``), or of the audio files under the
    folder ``audio``, as the tokenizer lists them (where the corpus cannot be rendered, e.g. on the GPU
    machine)."""
    if audio:
        from musiclm_stab.audio import list_audio_files

        files = [p.resolve() for p in list_audio_files(audio)]
        if not files:
            raise SystemExit(f"--audio {audio}: no audio files")
        return files[:tracks]
    from musiclm_stab.corpus.build import build_corpus

    return build_corpus(work / "corpus", num_tracks=max(tracks, 24), seed=0, progress=False)[:tracks]


def weights_file(work: Path, files: list[Path], given: str | None) -> str:
    if given:
        return given
    path = work / "encodec_local_seed0.th"
    if not path.exists():
        from musiclm_stab.tokenizer.fit import make_local_weights

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
    largest: list[tuple[float, int, str]] = []  # (time, RSS of the largest process then, which one)
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            each = []
            for p in [ps, *ps.children(recursive=True)]:
                try:  # the command itself is the wrapper's child ("main"); its children are "worker"s
                    each.append((p.memory_info().rss, "main" if p.ppid() == proc.pid else
                                 "wrapper" if p.pid == proc.pid else "worker"))
                except psutil.Error:  # a process that ended between listing and reading
                    pass
            peak = max(peak, sum(r for r, _ in each))
            largest.append((time.perf_counter() - t0, *max(each, default=(0, ""))))
        except psutil.Error:
            pass
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    # the largest process's RSS at its highest in each tenth of the run (flat when nothing grows with
    # time), and which process that was
    tenths = [max(((r, who) for t, r, who in largest if i * wall / 10 <= t < (i + 1) * wall / 10), default=(0, ""))
              for i in range(10)]
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    output = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    maxrss_kb = int(output.rstrip().splitlines()[-1].split()[-1])  # the wrapper's last line
    return {"wall_s": wall, "cpu_s": cpu, "peak_tree_rss_mb": peak / 2**20, "peak_process_rss_mb": maxrss_kb / 1024,
            "load_before": load, "largest_by_tenth_mb": [round(r / 2**20) for r, _ in tenths],
            "largest_by_tenth_is": [who for _, who in tenths], "output": output}


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

    from musiclm_stab.tokenizer.weights import load_encodec

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


def subset_folder(work: Path, files: list[Path]) -> Path:
    """A folder of links to ``files`` (the tokenizer's input), made anew."""
    subset = work / f"subset_{len(files)}"
    shutil.rmtree(subset, ignore_errors=True)
    subset.mkdir()
    for f in files:
        (subset / f.name).symlink_to(Path(f).resolve())
    return subset


def throughput(args, work: Path) -> dict:
    files = corpus(work, args.tracks, args.audio)
    weights = weights_file(work, files, args.weights)
    subset = subset_folder(work, files)
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


def _long_track_files(work: Path, args, minutes: list[float]) -> list[Path]:
    """The corpus, when something must be made from it (a long track not yet there, or weights)."""
    missing = [m for m in minutes if not (work / f"long_{m:g}min" / f"track_{m:g}min.flac").exists()]
    return corpus(work, 24) if missing or not args.weights else []


def memory(args, work: Path) -> dict:
    files = _long_track_files(work, args, [*args.minutes, *args.naive_minutes])
    weights = weights_file(work, files, args.weights)
    results = {}
    rows = []
    for minutes in args.minutes:
        folder = work / f"long_{minutes:g}min"
        folder.mkdir(exist_ok=True)
        long_track(files, minutes, folder / f"track_{minutes:g}min.flac")
    for repeat, minutes in ((rep, m) for rep in range(args.memory_repeats) for m in args.minutes):
        folder = work / f"long_{minutes:g}min"
        out = work / f"tokens_long_{minutes:g}min"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [*CLI, "tokenize", str(folder), str(out), "--weights", weights, "--no-progress",
               "--batch-size", str(args.batch_size)]
        if args.workers is not None:
            cmd += ["--workers", str(args.workers)]
        r = run_measured(cmd)
        line = [x for x in r["output"].splitlines() if x.startswith("tokenized")]
        records = [json.loads(p.read_text()) for p in (out / ".tokenize" / "units").glob("u*.json")]
        pids = {rec.get("pid") for rec in records}
        row = {k: r[k] for k in ("wall_s", "cpu_s", "peak_process_rss_mb", "peak_tree_rss_mb", "load_before",
                                 "largest_by_tenth_mb", "largest_by_tenth_is")}
        row.update(minutes=minutes, repeat=repeat, x_realtime=minutes * 60 / r["wall_s"], units=len(records),
                   worker_processes=len(pids - {None}))
        results[f"ours_{minutes:g}min_{repeat}"] = row
        rows.append(row)
        print(f"ours  {minutes:5g} min track, --batch-size {args.batch_size}: peak RSS {r['peak_process_rss_mb']:.0f} MB "
              f"(sampled, process tree: {r['peak_tree_rss_mb']:.0f} MB), {r['wall_s']:.0f} s "
              f"({minutes * 60 / r['wall_s']:.2f}x real time, CPU {r['cpu_s']:.0f} s), {len(records)} units by "
              f"{row['worker_processes']} worker processes; load average before {r['load_before']:.1f}; "
              f"largest process by tenth of the run (MB): {r['largest_by_tenth_mb']} "
              f"({', '.join(r['largest_by_tenth_is'])}); "
              f"{line[0] if line else ''}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    if rows:
        base = rows[0]["peak_process_rss_mb"]
        print("| track | repeat | peak RSS (largest process) | vs first | largest process, first / last tenth | time | "
              "real time factor | CPU | units / worker processes |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            tenths = row["largest_by_tenth_mb"]
            print(f"| {row['minutes']:g} min | {row['repeat']} | {row['peak_process_rss_mb']:.0f} MB | "
                  f"{100 * (row['peak_process_rss_mb'] / base - 1):+.1f}% | {tenths[0]} / {tenths[-1]} MB | "
                  f"{row['wall_s']:.0f} s | {row['x_realtime']:.1f}x | {row['cpu_s']:.0f} s | "
                  f"{row['units']} / {row['worker_processes']} |")
        for minutes in args.minutes:
            peaks = [r["peak_process_rss_mb"] for r in rows if r["minutes"] == minutes]
            print(f"{minutes:g} min: peak RSS over {len(peaks)} repeats {min(peaks):.0f}-{max(peaks):.0f} MB")
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


def _same_rows(a: Path, b: Path) -> bool:
    """Whether two tokenized outputs hold the same rows, bit for bit, in the same order."""
    from musiclm_stab.data.tokenized import load_tokenized

    da, db = load_tokenized(a)[0].with_format("numpy"), load_tokenized(b)[0].with_format("numpy")
    if da.num_rows != db.num_rows or da["id"] != db["id"]:
        return False
    for i in range(0, da.num_rows, 32):  # a few batches of rows at a time: bounded memory
        x, y = da[i : i + 32], db[i : i + 32]
        for col in ("start", "num_frames", "pcm", "codes"):
            if not all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(x[col], y[col], strict=True)):
                return False
    return True


def _codes_of(subset: Path, weights: str, out: Path, env: dict | None = None, extra: tuple = ()) -> tuple:
    """Tokenize ``subset`` in a fresh process (the tokenizer's defaults, plus ``extra``); its codes, as
    (codebooks, frames) over all rows in order, and the wall time."""
    from musiclm_stab.data.tokenized import load_tokenized

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([*CLI, "tokenize", str(subset), str(out), "--weights", weights, "--no-progress", *extra],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    data = load_tokenized(out)[0].with_format("numpy")
    codes = np.concatenate([np.asarray(c) for c in data["codes"]], axis=-1)
    shutil.rmtree(out)
    return codes, wall


def _agreement(codes: dict[str, np.ndarray], result: dict) -> dict:
    """Equal codes per codebook of every variant against the first, printed and added to ``result``."""
    names = list(codes)
    for name in names[1:]:
        same = (codes[name] == codes[names[0]]).mean(axis=-1)
        result[f"{name}_vs_{names[0]}"] = [round(float(x), 5) for x in same]
        print(f"{name} vs {names[0]}: equal codes per codebook {' '.join(f'{x:.4f}' for x in same)}; "
              f"overall {float((codes[name] == codes[names[0]]).mean()):.4f}", flush=True)
    print(json.dumps(result))
    return result


def capability(args, work: Path) -> dict:
    """The same tracks tokenized under each ATEN_CPU_CAPABILITY: equal codes per codebook vs the first."""
    files = corpus(work, args.tracks, args.audio)
    weights = weights_file(work, files, args.weights)
    subset = subset_folder(work, files)
    codes = {cap: _codes_of(subset, weights, work / f"tokens_{cap}", {**os.environ, "ATEN_CPU_CAPABILITY": cap})[0]
             for cap in args.capabilities}
    first = codes[args.capabilities[0]]
    return _agreement(codes, {"tracks": len(files), "frames": int(first.shape[-1]), "weights": Path(weights).name,
                              "cpu_capability_default": _cpu_capability()})


def devices(args, work: Path) -> dict:
    """The same tracks tokenized with each ``--device`` (fresh processes, TF32 off as the tokenizer always
    runs): equal codes per codebook vs the first device, and each one's real-time factor."""
    files = corpus(work, args.tracks, args.audio)
    weights = weights_file(work, files, args.weights)
    subset = subset_folder(work, files)
    audio_s = sum(sf.info(f).duration for f in files)
    codes, result = {}, {"tracks": len(files), "audio_seconds": audio_s, "weights": Path(weights).name}
    for i, device in enumerate(args.devices):
        name = f"{device}{i}" if args.devices.count(device) > 1 else device
        extra = ("--device", device, *(("--workers", str(args.workers)) if args.workers is not None else ()))
        codes[name], wall = _codes_of(subset, weights, work / f"tokens_{name}", extra=extra)
        result[f"{name}_x_realtime"] = audio_s / wall
        print(f"{name}: {audio_s:.0f} s of audio in {wall:.1f} s = {audio_s / wall:.1f}x real time "
              "(a fresh process: imports and model load included)", flush=True)
    result["frames"] = int(next(iter(codes.values())).shape[-1])
    return _agreement(codes, result)


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def workers(args, work: Path) -> dict:
    """One long track: whole in one worker vs in pieces shared by ``--workers`` workers; same rows?"""
    minutes = args.minutes[0]
    files = _long_track_files(work, args, [minutes])
    weights = weights_file(work, files, args.weights)
    folder = work / f"long_{minutes:g}min"
    folder.mkdir(exist_ok=True)
    long_track(files, minutes, folder / f"track_{minutes:g}min.flac")
    n = args.workers or 2
    results = {}
    for name, extra in (("whole, 1 worker", ["--workers", "1", "--piece-seconds", "0"]),
                        (f"pieces, {n} workers", ["--workers", str(n)] +
                         (["--piece-seconds", f"{args.piece_seconds:g}"] if args.piece_seconds else []))):
        out = work / f"tokens_workers_{len(results)}"
        shutil.rmtree(out, ignore_errors=True)
        r = run_measured([*CLI, "tokenize", str(folder), str(out), "--weights", weights, "--no-progress", *extra])
        records = [json.loads(p.read_text()) for p in (out / ".tokenize" / "units").glob("u*.json")]
        row = {"wall_s": round(r["wall_s"], 1), "cpu_s": round(r["cpu_s"], 1), "x_realtime": round(minutes * 60 / r["wall_s"], 2),
               "units": len(records), "worker_processes": len({rec.get("pid") for rec in records} - {None}),
               "peak_process_rss_mb": round(r["peak_process_rss_mb"]), "load_before": round(r["load_before"], 1)}
        results[name] = row
        print(f"{minutes:g} min track, {name}: {row}", flush=True)
    names = list(results)
    same = _same_rows(work / "tokens_workers_0", work / "tokens_workers_1")
    speedup = results[names[0]]["wall_s"] / results[names[1]]["wall_s"]
    print(f"rows bit-identical: {same}; wall-time speed-up {speedup:.2f}x with {n} workers")
    for i in range(2):
        shutil.rmtree(work / f"tokens_workers_{i}", ignore_errors=True)
    return {**results, "same_rows": same, "speedup": speedup}


def encode(args, work: Path) -> dict:
    """CPU time of encode_batch against model.encode on the same batches, alternating (module docstring)."""
    import torch

    from musiclm_stab.audio import load_audio
    from musiclm_stab.threads import one_thread
    from musiclm_stab.tokenizer.encode import encode_batch
    from musiclm_stab.tokenizer.weights import load_encodec, prepare_for_inference
    from musiclm_stab.tokenizer.workers import keep_freed_memory

    keep_freed_memory()  # as in a worker process
    files = corpus(work, args.tracks, args.audio)
    model, info = load_encodec(weights_file(work, files, args.weights))
    prepare_for_inference(model)
    seg = 240_000  # a 10 s segment
    waves = [load_audio(f) for f in files]
    pcm = torch.cat([w[: len(w) // seg * seg].view(-1, seg) for w in waves])
    batches = list(pcm.split(args.batch_size))

    def batched() -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat([model.encode(b.unsqueeze(1))[0][0].to(torch.int16) for b in batches])

    def ours() -> torch.Tensor:
        return torch.cat([encode_batch(model, b) for b in batches])

    ways = {"model.encode on the batch": batched, "encode_batch": ours}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    with one_thread():
        same = (batched() == ours()).float().mean().item()
        for r in range(args.repeats):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                t = time.process_time()
                ways[name]()
                cpu[name].append(time.process_time() - t)
    audio_s = len(pcm) * 10
    print(f"{len(pcm)} segments of 10 s from {len(files)} tracks, batches of {args.batch_size}, one thread; "
          f"weights {info['weights_sha256'][:12]}; equal codes {same:.6f}")
    print("| way | CPU s per audio s, each round | median |")
    print("|---|---|---|")
    med = {name: float(np.median(v)) / audio_s for name, v in cpu.items()}
    for name, v in cpu.items():
        print(f"| {name} | " + " ".join(f"{x / audio_s:.4f}" for x in v) + f" | {med[name]:.4f} |")
    ratio = med["encode_batch"] / med["model.encode on the batch"]
    print(f"encode_batch / model.encode on the batch, CPU time (medians): {ratio:.3f}")
    return {"segments": len(pcm), "equal_codes": same, "cpu_s": cpu, "ratio": ratio}


def boundary(args, work: Path) -> dict:
    """Equal codes, per codebook and position in a segment, between per-segment and whole-track encodes."""
    import torch

    from musiclm_stab.audio import load_audio
    from musiclm_stab.threads import one_thread
    from musiclm_stab.tokenizer.weights import load_encodec, prepare_for_inference

    files = corpus(work, args.tracks, args.audio)
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
    p.add_argument("what", choices=["throughput", "memory", "workers", "encode", "boundary", "capability",
                                    "devices", "naive-child", "maxrss-child"])
    p.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--work", default="/tmp/bench_tokenize")
    p.add_argument("--weights", default=None)
    p.add_argument("--tracks", type=int, default=8)
    p.add_argument("--audio", default=None,
                   help="throughput, encode, boundary, capability, devices: the first --tracks audio files of this "
                   "folder instead of the default corpus (rendered, which needs the corpus extras)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--minutes", type=float, nargs="+", default=[2, 60, 180])
    p.add_argument("--naive-minutes", type=float, nargs="*", default=[])
    p.add_argument("--memory-repeats", type=int, default=1,
                   help="memory: runs of each length, in rounds (the peak scatters between identical runs)")
    p.add_argument("--batch-size", type=int, default=8, help="memory, encode: the tokenizer's --batch-size")
    p.add_argument("--workers", type=int, default=None, help="memory, devices: the tokenizer's --workers (default: its own)")
    p.add_argument("--capabilities", nargs="+", default=["default", "avx2", "avx512"],
                   help="capability: ATEN_CPU_CAPABILITY values to compare, the first the reference")
    p.add_argument("--devices", nargs="+", default=["cpu", "cuda"],
                   help="devices: the tokenizer's --device values to compare, the first the reference")
    p.add_argument("--piece-seconds", type=float, default=None,
                   help="workers: the tokenizer's --piece-seconds for the run in pieces (default: its own, 300 s; "
                   "a track is cut when it holds two pieces of whole batches, i.e. from 640 s at --batch-size 8)")
    if sys.argv[1:2] == ["maxrss-child"]:
        maxrss_child(sys.argv[2:])
    args = p.parse_args()
    if args.what == "naive-child":
        naive_child(args.weights, args.files)
        return
    work = Path(args.work).resolve()  # the subset folder links to corpus files by absolute path
    work.mkdir(parents=True, exist_ok=True)
    {"throughput": throughput, "memory": memory, "workers": workers, "encode": encode,
     "boundary": boundary, "capability": capability, "devices": devices}[args.what](args, work)


if __name__ == "__main__":
    main()
