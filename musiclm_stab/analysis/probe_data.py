"""What the probes read: a run's tokenized data joined to the corpus labels, and frozen features of it.

    load_probe_data(run_dir, labels=None, frame_stride=6)      -> ProbeData (items and their labels)
    feature_sets(run_dir, data, layers, baselines, seed, ...)   -> {name: FeatureSet}, cached in the run dir

Items. Frame items are every ``frame_stride``-th frame of the tracks (track frames g with g % stride == 0,
so a frame is the same item whatever segment holds it; by default the stride that keeps at most 8,000):
the pitch task. Segment items are the tokenized
rows (10 s segments; a track's last one is shorter): the key and instrument tasks, on the mean over all of
a segment's frames. Frame t of a row is track frame round(start * 75) + t (the tokenizer's and the
labels' frames are both [t/75, (t+1)/75) s of the track), which is how the labels join back to segments
(by the row's ``track``, the audio file's name in the corpus folder).

Feature sets. "model": the run's checkpoint; "random_init": the same config's MusicMLM drawn with the
probe seed (no checkpoint); "cqt": log CQT magnitude with the run's CQT settings, frame t centred on
sample 320t + 160 like the model's frames; "codes": the EnCodec codes of the row, one-hot per codebook
and concatenated (8 x 1024 dimensions, kept as indices: a linear map of them is a sum of per-codebook
embeddings); "prior": no features at all (the probe learns only its bias: the training label frequencies).
The model's layer l is the l-th of its N+1 hidden states (export/features.py: 0 = the input of the
first transformer layer). Features are extracted once and cached in ``RUN/probe/cache``, keyed by
everything they depend on; the random-init features are also read from the caches of the runs beside
RUN (the same architecture, probe seed and data give the same features whatever the run's lr or seed).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import config_from_run
from musiclm_stab.constants import FRAME_RATE, SAMPLE_RATE
from musiclm_stab.corpus.labels import KEY_NAMES, LABELS_FILE, CorpusLabels
from musiclm_stab.export.features import FeatureModel, load_feature_model, resolve_layers
from musiclm_stab.model import MusicMLM
from musiclm_stab.model.cqt import CQT
from musiclm_stab.training.trained import resolve_checkpoint

CACHE_VERSION = 1  # bump when the cached features of the same inputs would change
BASELINES = ("random_init", "cqt", "codes", "prior")
CQT_FLOOR = 1e-3  # log(|CQT| + floor): quiet bins stay finite (a full-scale sinusoid reads ~10-113)
BATCH_ROWS = 8  # rows of equal length per forward pass
MAX_FRAME_ITEMS = 8000  # the default frame stride keeps the pitch task at most this many frames


@dataclass
class ProbeData:
    """Probe items of a tokenized dataset and their labels (see the module docstring)."""

    data_path: str | list[str]
    labels_dir: Path
    info: dict  # tokenizer.json of the data
    tracks: list[str]  # track names, in dataset order
    row_track: np.ndarray  # int [R]: index into tracks
    row_start: np.ndarray  # int [R]: first track frame of the row
    row_frames: np.ndarray  # int [R]
    frame_row: np.ndarray  # int [F]: the row of each frame item
    frame_t: np.ndarray  # int [F]: the frame within its row
    pitch: np.ndarray  # bool [F, P]: targets of the frame items over ``pitch_space``
    pitch_space: list[int]  # MIDI pitches active anywhere in the labelled tracks
    key: np.ndarray  # int [n_tracks]: 0-23 (KEY_NAMES), -1 when the track has no key label
    instrument: np.ndarray  # int [n_tracks]: GM family (program // 8) of the top voice
    frame_stride: int
    ids_sha256: str = ""  # of the row ids, in order: what the cached features are of
    rows: list[int] = field(default_factory=list)  # dataset indices of the rows

    @property
    def frame_track(self) -> np.ndarray:
        return self.row_track[self.frame_row]


def _labels_dir_for(info: dict, data_path, labels: str | Path | None) -> Path:
    if labels is not None:
        return Path(labels)
    source = info.get("source")
    if info.get("source_kind") == "folder" and source and (Path(source) / LABELS_FILE).is_file():
        return Path(source)
    raise ConfigError(
        f"the data {data_path} was tokenized from {source!r}, which has no {LABELS_FILE}: pass --labels "
        "CORPUS_DIR (a corpus built by `musiclm-stab build-corpus` with the same options holds the same audio; "
        "running build-corpus again on a corpus made before labels existed adds them)"
    )


def _check_same_corpus(labels_dir: Path, info: dict) -> None:
    """If the data's source folder has a corpus.json too, it must describe the same corpus."""
    source = info.get("source")
    if not source or Path(source).resolve() == labels_dir.resolve():
        return
    a, b = Path(source) / "corpus.json", labels_dir / "corpus.json"
    if a.is_file() and b.is_file():
        ca, cb = json.loads(a.read_text()).get("config"), json.loads(b.read_text()).get("config")
        if ca != cb:
            raise ConfigError(f"the labels in {labels_dir} are of a corpus with config {cb}, the data was "
                              f"tokenized from {source} with config {ca}: not the same audio")


def load_probe_data(run_dir: str | Path, labels: str | Path | None = None, frame_stride: int | None = None,
                    data: str | list[str] | None = None) -> ProbeData:
    """The probe items of a run's data (``data.path`` of its config unless ``data`` is given).

    ``frame_stride`` None: the smallest stride that gives at most MAX_FRAME_ITEMS frame items (13 for the
    default corpus: 7,500 frames at 5.8 Hz), so the pitch probes' cost is bounded whatever the corpus.
    """
    from musiclm_stab.data.tokenized import check_same_tokenizer, load_tokenized

    if frame_stride is not None and frame_stride < 1:
        raise ValueError(f"frame_stride must be >= 1, got {frame_stride}")
    run_dir = Path(run_dir)
    cfg = config_from_run(run_dir)
    data_path = data or cfg.data.path
    ds, info = load_tokenized(data_path)
    run_tok = run_dir / "tokenizer.json"
    if run_tok.is_file():
        check_same_tokenizer(json.loads(run_tok.read_text()), info, f"run {run_dir}", f"data {data_path}")
    labels_dir = _labels_dir_for(info, data_path, labels)
    _check_same_corpus(labels_dir, info)
    corpus = CorpusLabels(labels_dir)

    meta = ds.select_columns(["id", "track", "start", "num_frames"])
    ids, row_tracks = meta["id"], meta["track"]
    starts, frames = meta["start"], meta["num_frames"]
    tracks = list(dict.fromkeys(row_tracks))
    index = {t: i for i, t in enumerate(tracks)}
    row_track = np.array([index[t] for t in row_tracks], dtype=np.int64)
    row_start = np.array([round(s * FRAME_RATE) for s in starts], dtype=np.int64)
    row_frames = np.array(frames, dtype=np.int64)
    if frame_stride is None:
        frame_stride = max(1, -(-int(row_frames.sum()) // MAX_FRAME_ITEMS))

    for t in tracks:  # each track is labelled, and the labels reach as far as its segments do
        row = corpus.row(t)
        end = int(max(row_start[i] + row_frames[i] for i in np.flatnonzero(row_track == index[t])))
        if end > row["num_frames"] + 1:
            raise ConfigError(f"track {t}: the data has {end} frames, its labels in {labels_dir} only "
                              f"{row['num_frames']}: the labels are not of this audio")

    pitch_space = sorted({p for t in tracks for p in np.flatnonzero(corpus.arrays(t)["pitch"].any(0))})
    frame_row, frame_t, targets = [], [], []
    for r in range(len(row_track)):
        offset = (-row_start[r]) % frame_stride  # first t with (start + t) % stride == 0
        ts = np.arange(offset, row_frames[r], frame_stride)
        seg = corpus.segment_pitch(tracks[row_track[r]], float(starts[r]), int(row_frames[r]))
        frame_row.append(np.full(len(ts), r))
        frame_t.append(ts)
        targets.append(seg[ts][:, pitch_space])
    keys = np.array([-1 if corpus.row(t).get("key") is None or corpus.row(t)["key"].get("index") is None
                     else corpus.row(t)["key"]["index"] for t in tracks], dtype=np.int64)
    instrument = np.array([corpus.row(t)["top_family"] for t in tracks], dtype=np.int64)
    assert keys.max(initial=-1) < len(KEY_NAMES)
    return ProbeData(
        data_path=data_path, labels_dir=labels_dir, info=info, tracks=tracks, row_track=row_track,
        row_start=row_start, row_frames=row_frames, frame_row=np.concatenate(frame_row),
        frame_t=np.concatenate(frame_t), pitch=np.concatenate(targets), pitch_space=[int(p) for p in pitch_space],
        key=keys, instrument=instrument, frame_stride=frame_stride,
        ids_sha256=hashlib.sha256("\n".join(ids).encode()).hexdigest(), rows=list(range(len(ids))),
    )


# ------------------------------------------------------------------------------------------ features


@dataclass
class FeatureSet:
    """Features of the probe items, per layer: ``frames[l]`` [F, D] float32 (codes: int64 [F, K] of
    one-hot indices k * V + code), ``segments[l]`` [R, D] float32 (the mean over each row's frames)."""

    name: str
    kind: str  # "dense" or "codes"
    frames: dict[int, torch.Tensor]
    segments: dict[int, torch.Tensor]
    source: str = ""
    codes_dim: int = 0  # K * V for kind "codes"


def _rows_in_batches(data: ProbeData):
    """Row indices in batches of equal length (a forward pass needs one length), dataset order within."""
    by_len: dict[int, list[int]] = {}
    for r, n in enumerate(data.row_frames):
        by_len.setdefault(int(n), []).append(r)
    for rows in by_len.values():
        for i in range(0, len(rows), BATCH_ROWS):
            yield rows[i : i + BATCH_ROWS]


def _dataset(data: ProbeData):
    from musiclm_stab.data.tokenized import load_tokenized

    ds, _ = load_tokenized(data.data_path)
    return ds


def _extract(data: ProbeData, name: str, layers: list[int], forward, desc: str, progress: bool
             ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Run ``forward(wav [B, S]) -> {layer: [B, T, D]}`` over all rows; keep the frame items and means."""
    ds = _dataset(data).select_columns(["pcm"]).with_format("numpy")
    frames: dict[int, torch.Tensor] = {}
    segments: dict[int, torch.Tensor] = {}
    items_of_row = np.split(np.arange(len(data.frame_row)), np.cumsum(np.bincount(data.frame_row,
                                                                                  minlength=len(data.row_frames)))[:-1])
    bar = tqdm(total=len(data.row_frames), desc=desc, unit="seg", disable=not progress, leave=False)
    for rows in _rows_in_batches(data):
        wav = torch.from_numpy(np.stack([np.asarray(ds[int(data.rows[r])]["pcm"], dtype=np.float32) for r in rows]))
        T = int(data.row_frames[rows[0]])
        with torch.inference_mode():
            out = forward(wav[:, : T * (SAMPLE_RATE // FRAME_RATE)])
        for layer in layers:
            h = out[layer].float()
            if h.shape[1] != T:
                raise RuntimeError(f"{name}: {h.shape[1]} frames for a segment of {T}")
            if layer not in frames:
                frames[layer] = torch.empty(len(data.frame_row), h.shape[-1])
                segments[layer] = torch.empty(len(data.row_frames), h.shape[-1])
            for b, r in enumerate(rows):
                frames[layer][items_of_row[r]] = h[b, data.frame_t[items_of_row[r]]]
                segments[layer][r] = h[b].mean(0)
        bar.update(len(rows))
    bar.close()
    return frames, segments


def random_init_model(run_dir: str | Path, seed: int) -> FeatureModel:
    """The run's architecture with freshly drawn weights (torch's RNG seeded with ``seed``, then restored)."""
    cfg = config_from_run(run_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MusicMLM(cfg.model)
    return FeatureModel(model, "musiclm_stab", model.cfg.num_layers, model.cfg.width, f"random init, seed {seed}")


def _model_forward(model: FeatureModel, layers: list[int]):
    def forward(wav: torch.Tensor) -> dict[int, torch.Tensor]:
        hidden = model.hidden_states(wav)
        return {layer: hidden[layer] for layer in layers}
    return forward


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_key(data: ProbeData, what: dict) -> tuple[dict, str]:
    key = {"version": CACHE_VERSION, "rows": data.ids_sha256, "num_rows": len(data.row_frames),
           "weights_sha256": data.info.get("weights_sha256"), "frame_stride": data.frame_stride, **what}
    return key, hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cached(run_dir: Path, name: str, data: ProbeData, what: dict, make, use_cache: bool,
            siblings: bool = False) -> FeatureSet:
    """The feature set from ``RUN/probe/cache`` when its key matches, else ``make()`` (then cached).
    ``siblings``: also read a match from the caches of the runs beside this one (features that do not depend
    on the run's weights, such as its architecture at random init, are the same for every run of that
    architecture: a study's runs at other learning rates or training seeds share them)."""
    key, digest = _cache_key(data, what)
    path = run_dir / "probe" / "cache" / f"{name}-{digest}.pt"
    if use_cache:
        found = [path] + (sorted(run_dir.parent.glob(f"*/probe/cache/{path.name}")) if siblings else [])
        for candidate in dict.fromkeys(found):
            if candidate.is_file():
                saved = torch.load(candidate, weights_only=True)
                if saved.get("key") == json.loads(json.dumps(key, sort_keys=True, default=str)):
                    return FeatureSet(name, saved["kind"], saved["frames"], saved["segments"], saved["source"])
    fs = make()
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        torch.save({"key": json.loads(json.dumps(key, sort_keys=True, default=str)), "kind": fs.kind,
                    "frames": fs.frames, "segments": fs.segments, "source": fs.source}, partial)
        partial.replace(path)
    return fs


def feature_sets(run_dir: str | Path, data: ProbeData, layers: Sequence[int] | None = None,
                 baselines: Sequence[str] = BASELINES, seed: int = 0, use_cache: bool = True,
                 progress: bool = True) -> dict[str, FeatureSet]:
    """{"model": ..., and each of ``baselines``}: the features of ``data``'s items (module docstring)."""
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise ConfigError(f"unknown baselines {sorted(unknown)}; choose from {list(BASELINES)}")
    run_dir = Path(run_dir)
    _, ckpt = resolve_checkpoint(run_dir)
    model = load_feature_model(ckpt, "cpu")
    chosen = resolve_layers(layers, model.num_layers)
    out: dict[str, FeatureSet] = {}

    def from_model(name: str, m: FeatureModel):
        return lambda: FeatureSet(name, "dense", *_extract(data, name, chosen, _model_forward(m, chosen),
                                                           name, progress), source=m.source)

    weights = ckpt / "model.safetensors"
    out["model"] = _cached(run_dir, "model", data, {"feature": "model", "layers": chosen,
                                                    "sha256": _file_sha256(weights)},
                           from_model("model", model), use_cache)
    mcfg = config_from_run(run_dir).model.resolved()
    if "random_init" in baselines:
        out["random_init"] = _cached(
            run_dir, "random_init", data, {"feature": "random_init", "layers": chosen, "seed": seed,
                                           "model": asdict(mcfg), "torch": torch.__version__},
            lambda: from_model("random_init", random_init_model(run_dir, seed))(), use_cache, siblings=True)
    if "cqt" in baselines:
        cqt = CQT(SAMPLE_RATE, fmin=mcfg.cqt_fmin, n_bins=mcfg.cqt_bins, bins_per_octave=mcfg.cqt_bins_per_octave)

        def make_cqt() -> FeatureSet:
            f, s = _extract(data, "cqt", [0], lambda wav: {0: torch.log(cqt(wav) + CQT_FLOOR)}, "cqt", progress)
            return FeatureSet("cqt", "dense", f, s, source=f"log(|CQT| + {CQT_FLOOR:g}), {mcfg.cqt_bins} bins "
                              f"from {mcfg.cqt_fmin} Hz, {mcfg.cqt_bins_per_octave} per octave")

        out["cqt"] = _cached(run_dir, "cqt", data, {"feature": "cqt", "fmin": mcfg.cqt_fmin, "bins": mcfg.cqt_bins,
                                                    "bpo": mcfg.cqt_bins_per_octave}, make_cqt, use_cache)
    if "codes" in baselines:
        out["codes"] = codes_features(data)
    if "prior" in baselines:
        out["prior"] = FeatureSet("prior", "dense", {0: torch.zeros(len(data.frame_row), 0)},
                                  {0: torch.zeros(len(data.row_frames), 0)}, source="no features (bias only)")
    return out


def codes_features(data: ProbeData) -> FeatureSet:
    """EnCodec codes as one-hot indices k * V + code of the frame items, and per-segment code histograms
    (the mean of the one-hot vectors over the segment's frames, [R, K * V])."""
    ds = _dataset(data).select_columns(["codes"]).with_format("numpy")
    K, V = int(data.info.get("num_codebooks", 8)), int(data.info.get("codebook_size", 1024))
    offsets = torch.arange(K) * V
    frames = torch.empty(len(data.frame_row), K, dtype=torch.int64)
    segments = torch.zeros(len(data.row_frames), K * V)
    for r in range(len(data.row_frames)):
        codes = ds[int(data.rows[r])]["codes"]
        codes = torch.from_numpy(np.stack(codes) if codes.dtype == object else codes).long()  # [K, T]
        idx = (codes + offsets[:, None]).T  # [T, K]
        items = np.flatnonzero(data.frame_row == r)
        frames[items] = idx[data.frame_t[items]]
        segments[r].index_add_(0, idx.reshape(-1), torch.full((idx.numel(),), 1.0 / idx.shape[0]))
    return FeatureSet("codes", "codes", {0: frames}, {0: segments}, source=f"EnCodec codes, one-hot per codebook "
                      f"({K} x {V}), concatenated", codes_dim=K * V)


def folds_of_tracks(num_tracks: int, folds: int, seed: int) -> list[np.ndarray]:
    """Track indices of each fold: a seeded permutation dealt round-robin (fold sizes differ by <= 1)."""
    if folds < 3:
        raise ValueError(f"folds must be >= 3 (one to test, one to choose the L2 penalty, the rest to train), "
                         f"got {folds}")
    if num_tracks < folds:
        raise ConfigError(f"{num_tracks} tracks cannot be split into {folds} folds; use --folds {max(3, num_tracks)}"
                          if num_tracks >= 3 else f"probing needs at least 3 tracks, the data has {num_tracks}")
    perm = np.random.default_rng(np.random.SeedSequence([seed, 0x9E0B])).permutation(num_tracks)
    return [np.sort(perm[k::folds]) for k in range(folds)]


def describe_items(data: ProbeData) -> dict:
    """Sizes for the results file."""
    return {"tracks": len(data.tracks), "segments": len(data.row_frames), "frames": len(data.frame_row),
            "frame_stride": data.frame_stride, "frame_items_hz": FRAME_RATE / data.frame_stride,
            "pitch_space": [min(data.pitch_space), max(data.pitch_space)] if data.pitch_space else None,
            "num_pitches": len(data.pitch_space), "seconds": float(data.row_frames.sum() / FRAME_RATE),
            "tracks_with_key": int((data.key >= 0).sum()), "mean_active_pitches": float(data.pitch.sum(1).mean())
            if len(data.pitch) else math.nan}
