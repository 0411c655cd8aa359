"""Linear probes on frozen features, with labels from the rendered scores (musiclm-stab probe)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from inproc import fresh_accelerate

pytest.importorskip("music21")
pytest.importorskip("tinysoundfont")

from musiclm_stab.analysis import probe, probe_data, probe_fit  # noqa: E402
from musiclm_stab.config import ConfigError, load_config  # noqa: E402
from musiclm_stab.corpus import build  # noqa: E402
from musiclm_stab.corpus.labels import read_labels  # noqa: E402
from musiclm_stab.model.cqt import CQT  # noqa: E402


def _rendered_and_tokenized(root, local_weights, max_seconds: float):
    """4 chorales cut at ``max_seconds`` (labels written by build_corpus), tokenized in 10 s segments:
    (corpus dir, tokens dir)."""
    from musiclm_stab.tokenizer.pipeline import tokenize

    corpus = root / "corpus"
    build.build_corpus(corpus, num_tracks=4, seed=0, max_seconds=max_seconds, progress=False)
    tokens = root / "tokens"
    tokenize(corpus, tokens, weights=str(local_weights), segment_seconds=10.0, min_seconds=1.0, progress=False,
             weights_note="test weights fitted on synthetic music", workers=0)
    return corpus, tokens


@pytest.fixture(scope="module")
def rendered_tokens(tmp_path_factory, local_weights):
    """4 chorales cut at 14 s, tokenized: (corpus dir, tokens dir). Each track gives a 10 s and a 4 s segment."""
    return _rendered_and_tokenized(tmp_path_factory.mktemp("probe"), local_weights, 14)


@pytest.fixture(scope="module")
def short_rendered_tokens(tmp_path_factory, local_weights):
    """The same 4 chorales cut at 4 s, tokenized: one 4 s segment each. The study's probes take every frame
    (1200 here, 4200 of the 14 s cut), so its test probes these; so do the probe tests where the amount of
    audio is not the point (``data=``: the 14 s run probes these instead of its own data)."""
    return _rendered_and_tokenized(tmp_path_factory.mktemp("probe_short"), local_weights, 4)


def train(cfg):
    """Train ``cfg`` with the in-process Trainer; its run directory."""
    from musiclm_stab.training.trainer import Trainer

    with fresh_accelerate():
        return Trainer(cfg).run()


@pytest.fixture(scope="module")
def trained_run(rendered_tokens, tmp_path_factory):
    """A tiny run of 2 steps on the rendered corpus (in-process Trainer): its run directory."""
    out = tmp_path_factory.mktemp("runs")
    return train(load_config("recipes/tiny.yaml", [
        f"--data.path={rendered_tokens[1]}", f"--train.output_dir={out}", "--train.name=run",
        "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3", "--optim.warmup_steps=1",
        "--train.max_steps=2", "--train.checkpoint_every=2"]))


def test_labels_join_tokenized_segments_in_time(rendered_tokens):
    """The labels of each tokenized segment (joined by its track and start) line up with its 24 kHz audio
    to the frame: the log-CQT rises most at the labelled note onsets, less one frame either way."""
    from musiclm_stab.data.tokenized import load_tokenized

    corpus, tokens = rendered_tokens
    labels = read_labels(corpus)
    ds, _ = load_tokenized(tokens)
    cqt = CQT(24000, fmin=32.70319566, n_bins=84, bins_per_octave=12)  # bin k = MIDI pitch 24 + k
    shifts = list(range(-3, 4))
    rise, count = np.zeros(len(shifts)), 0
    for row in ds.with_format("numpy"):
        roll = labels.segment_pitch(row["track"], float(row["start"]), int(row["num_frames"]))[:, 24:108]
        spec = torch.log(cqt(torch.from_numpy(row["pcm"])[None])[0] + 1e-3).numpy()  # [T, 84]
        d = np.zeros_like(spec)
        d[1:-1] = spec[2:] - spec[:-2]  # rise centred on frame t
        onsets = roll & ~np.roll(roll, 1, axis=0)
        onsets[0], onsets[:, :24] = False, False  # below MIDI 48 the CQT kernels are long (> 10 frames)
        for i, s in enumerate(shifts):  # onsets moved s frames later against the audio
            rise[i] += d[8:-8][np.roll(onsets, s, axis=0)[8:-8]].sum()
        count += int(onsets[8:-8].sum())
    rise /= count
    assert count > 100 and int(np.argmax(rise)) == shifts.index(0), dict(zip(shifts, rise.round(3)))
    # margin: measured on the 24-track default corpus 1.22 at 0 vs 1.02 / 0.90 one frame late / early
    assert rise[3] > 1.05 * max(rise[2], rise[4]), dict(zip(shifts, rise.round(3)))


def test_probe_scores_every_layer_and_baseline_deterministically(trained_run, rendered_tokens, tmp_path, monkeypatch):
    """`probe` on a trained run gives per-layer scores of the run and its random init, and CQT, codes and
    no-feature baselines, for pitch, key and instrument, with intervals; writes the JSON and the figure;
    a second call reads the cached features and gives the same numbers."""
    corpus, _ = rendered_tokens
    monkeypatch.chdir(tmp_path)
    assert probe.cli_main([str(trained_run), "--folds", "3", "--frame-stride", "10", "--l2", "0.01"]) == 0
    result = json.loads((trained_run / "probe" / "probe.json").read_text())
    assert result["labels"] == str(corpus)  # found from the data's tokenizer.json
    assert (trained_run / "figures" / "probe.png").stat().st_size > 10_000
    layers = [str(i) for i in range(3)]  # the tiny model: 2 transformer layers, 3 hidden states
    assert list(result["results"]) == ["model", "random_init", "cqt", "codes", "prior"]
    assert list(result["results"]["model"]) == list(result["results"]["random_init"]) == layers
    for name, by_layer in result["results"].items():
        for layer, tasks in by_layer.items():
            assert set(tasks) == {"pitch", "key", "instrument"}, (name, layer)
            for task, scores in tasks.items():
                metric = probe.PRIMARY[task]
                lo, hi = scores["ci95"][metric]
                assert 0.0 <= lo <= scores[metric] <= hi <= 1.0, (name, layer, task, scores)
                assert scores["tracks"] == 4 and scores["l2"] == [0.01] * 3
    pitch = {n: r["0"]["pitch"]["map"] for n, r in result["results"].items()}
    # the labels are of this audio: log CQT finds the pitches far above no features (measured here 0.25 vs
    # 0.08, with 2 training tracks per fold; 0.64 vs 0.07 on the 24-track default corpus)
    assert pitch["cqt"] > pitch["prior"] + 0.08
    assert sorted(sum(result["fold_tracks"], [])) == sorted(read_labels(corpus).rows)

    def no_extraction(*args, **kwargs):
        raise AssertionError("features extracted again instead of read from the cache")

    monkeypatch.setattr(probe_data, "_extract", no_extraction)
    again = probe.probe_run(trained_run, folds=3, frame_stride=10, progress=False, write=False, l2_grid=[0.01],
                            tasks=["key", "instrument"], baselines=["random_init"])  # a subset: fast
    for name in ("model", "random_init"):
        for layer, tasks in again["results"][name].items():
            assert tasks == {t: result["results"][name][layer][t] for t in tasks}
    table = probe.format_table(result)
    assert "random_init" in table and "pitch mAP" in table and "model - random_init, layer 2" in table
    summary = probe.summary(result)
    assert set(summary) == {"pitch", "key", "instrument"}
    score, layer = probe.best_layer(result)
    assert (score, layer) == (summary["pitch"]["model"], summary["pitch"]["model_layer"])
    assert score == max(result["results"]["model"][str(i)]["pitch"]["map"] for i in range(3))
    for layer, tasks in result["results"]["model"].items():  # model - random init, paired over tracks
        for task, scores in tasks.items():
            paired, metric = scores["vs_random_init"], probe.PRIMARY[task]
            assert paired["diff"] == pytest.approx(scores[metric] - result["results"]["random_init"][layer][task][metric])
            assert paired["ci95"][0] <= paired["diff"] <= paired["ci95"][1], (layer, task, paired)


def test_study_probes_seed_zero_of_each_configuration(short_rendered_tokens, tmp_path, capsys):
    """`study --probe`'s step, two runs at a time: the pitch probes of seed 0 of each of the four
    configurations (not the other seeds), against random init at the one L2 penalty, their figure among the
    study's figures, and the claims table's probe column with one value per configuration."""
    from musiclm_stab.analysis.claims import write_claims
    from musiclm_stab.experiments.study_plan import plan_study
    from musiclm_stab.experiments.study_probes import PROBE, probe_study

    extra = ["model.num_layers=1", "data.batch_size=2", "data.eval_fraction=0.3", "train.eval_every=0",
             "train.diagnostics_every=0"]
    study = plan_study("cpu", tmp_path / "runs", short_rendered_tokens[1], steps=1, seeds=2, lrs=(1e-2,),
                       control=False, extra=extra)  # one step: a run to probe, half the cost of two
    dirs = [train(run.config()) for run in study.runs]
    # no held-out loss (eval_every 0): no best cell beyond the figure lr's runs
    figure = probe_study(study, jobs=2)  # two runs at a time, in spawned processes
    shown = capsys.readouterr()  # one bar over the runs stands in for the workers' silenced bars
    assert "probes (2 runs at a time): 100%" in shown.err and "4/4" in shown.err, shown.err
    assert shown.out.count("probed ") == 4 and "4/4 done" in shown.out, shown.out
    assert figure == study.figures_dir / "probe.png" and figure.stat().st_size > 10_000
    probed = [d for d in dirs if (d / "probe" / "probe.json").is_file()]
    assert probed == [run.config().run_dir for run in study.runs if run.seed == 0] and len(probed) == 4
    for d in probed:
        result = probe.read_probe(d)
        assert result["tasks"] == ["pitch"] and list(result["results"]) == ["model", "random_init"]
        assert result["l2_grid"] == list(PROBE["l2_grid"]) and list(result["results"]["model"]) == ["0", "1"]
    md, _ = write_claims(dirs, study.figures_dir)
    row = next(line for line in md.read_text().splitlines() if line.startswith("| probe: best-layer pitch mAP"))
    cells = [c.strip() for c in row.strip("|").split("|")[1:]]
    assert len(cells) == 4 and all(0.0 < float(c) <= 1.0 for c in cells), row  # one seed: a single value

    # carried elsewhere without checkpoints: the probes are read, not run again (there is nothing to probe)
    before = {d: (d / "probe" / "probe.json").read_bytes() for d in probed}
    for d in dirs:
        shutil.rmtree(d / "checkpoints")
    figure.unlink()
    assert probe_study(study, progress=False, jobs=2) == figure and figure.is_file()
    assert {d: (d / "probe" / "probe.json").read_bytes() for d in probed} == before
    # A study in pieces probes every cell's first seed, but probe.png draws only the claims' runs: here the
    # figure lr's (1e-2, the grid's second lr), not the four at lr 3e-3 (copies of them, already probed).
    import yaml
    from matplotlib.image import imread

    from musiclm_stab.analysis.probe_figure import save_probe_figure
    from musiclm_stab.experiments.study_probes import probed_already

    wider = plan_study("cpu", tmp_path / "runs", short_rendered_tokens[1], steps=1, seeds=2, lrs=(3e-3, 1e-2),
                       control=False, extra=extra)
    for d in dirs:
        copy = shutil.copytree(d, d.with_name(d.name.replace("_lr1e-2_", "_lr3e-3_")))
        cfg = yaml.safe_load((copy / "config.yaml").read_text())
        cfg["optim"]["lr"] = 3e-3
        (copy / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert all(d.is_dir() for d in wider.run_dirs()) and len(wider.run_dirs()) == 16
    claims_only = imread(figure).shape  # the four probes of the figure lr; wider draws to the same file
    drawn = probe_study(wider, progress=False, every_first_seed=True)
    assert drawn == figure and imread(drawn).shape == claims_only
    every = [probed_already(d) for d in wider.run_dirs() if d.name.endswith("_s0")]
    assert len(every) == 8 and all(every)  # all eight probes drawn would need more legend rows: taller
    assert imread(save_probe_figure(every, tmp_path / "every.png")).shape[0] > claims_only[0]
    # a probe of another step is not the run's: probed again, which needs the checkpoint it no longer has
    result = json.loads(before[probed[0]])
    (probed[0] / "probe" / "probe.json").write_text(json.dumps({**result, "step": result["step"] - 1}))
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        probe_study(study, progress=False, jobs=1)


def test_study_probes_the_figure_lr_and_the_best_cell(tmp_path):
    """probe_targets: seed 0 of each configuration at the figure lr, plus seed 0 of the cell the "learns" check
    reads (lr_grid.best_cell: the lowest mean final held-out cb0 over the seeds, a diverged seed at the cap)
    when that is another cell; the QK-norm control and cells outside complete blocks never make it."""
    import math
    from dataclasses import replace

    from musiclm_stab.analysis.claim_stats import ROLES, Instability, RunStats
    from musiclm_stab.analysis.lr_grid import learns
    from musiclm_stab.experiments.study_plan import CONTROL, STUDY_RECIPES, figure_runs, plan_study
    from musiclm_stab.experiments.study_probes import probe_targets

    study = plan_study("cpu", tmp_path, "/data/tokens", seeds=2, lrs=(3e-3, 1e-2))
    run_dirs = [run.config().run_dir for run in study.runs]  # once: each config() reads the recipe files again
    figure = [r.config().run_dir for r in figure_runs(study) if r.seed == 0]
    assert len(figure) == 4 and all("_lr1e-2_s0" in d.name for d in figure)
    role = dict(zip(STUDY_RECIPES, ROLES)) | {CONTROL: "qknorm"}

    def stats(best: tuple[str, float], diverged: tuple[str, float] | None = None, drop=None,
              low: float = 5.0) -> list[RunStats]:
        out = []
        for run, run_dir in zip(study.runs, run_dirs):
            cell = (run.stem, run.lr)
            if (cell, run.seed) == drop:
                continue
            loss = 7.0 if cell == best else 6.0 if run.stem == CONTROL else 8.0 + run.seed
            gone = cell == diverged and run.seed == 1  # seed 0 the lowest of all, seed 1 diverged (cap 10)
            if cell == diverged:
                loss = low if run.seed == 0 else math.nan
            out.append(RunStats(path=str(run_dir), role=role[run.stem], lr=run.lr, seed=run.seed,
                                precision="fp32", early_loss=math.nan, median_grad_norm=math.nan,
                                peak_ratio=math.nan, clip_share_early=math.nan,
                                instability=Instability(0, 0, 0, gone), final_eval_cb0=loss, initial_eval_cb0=10.0))
        return out

    deepnorm_3e3 = tmp_path / "study_cpu" / f"{STUDY_RECIPES[2]}_tiny_lr3e-3_s0"
    assert probe_targets(study, stats((STUDY_RECIPES[2], 3e-3))) == [*figure, deepnorm_3e3]
    assert probe_targets(study, stats((STUDY_RECIPES[1], 1e-2))) == figure  # the best is already a figure run
    # a diverged seed counts at the cap, as in "learns": (5 + 10) / 2 = 7.5 loses to 7
    both = stats((STUDY_RECIPES[1], 1e-2), diverged=(STUDY_RECIPES[0], 3e-3))
    assert probe_targets(study, both) == figure
    assert learns(both, None)["best"]["role"] == "clip1"
    both = stats((STUDY_RECIPES[1], 1e-2), diverged=(STUDY_RECIPES[0], 3e-3), low=3.0)  # (3 + 10) / 2 < 7
    assert probe_targets(study, both) == [*figure, tmp_path / "study_cpu" / f"{STUDY_RECIPES[0]}_tiny_lr3e-3_s0"]
    assert (learns(both, None)["best"]["role"], learns(both, None)["best"]["lr"]) == ("clip10", 3e-3)
    # the best cell lies in an incomplete block (relax missing at lr 3e-3, seed 1): the check does not read it
    assert probe_targets(study, stats((STUDY_RECIPES[2], 3e-3), drop=((STUDY_RECIPES[3], 3e-3), 1))) == [
        *figure, deepnorm_3e3]  # block (3e-3, 0) is still complete; with seed 0 gone too it is not
    gone = [s for s in stats((STUDY_RECIPES[2], 3e-3)) if not (s.lr == 3e-3 and s.role == "relax")]
    assert probe_targets(study, gone) == figure
    assert probe_targets(study, []) == figure  # nothing trained yet: no block, no best cell
    twice = stats((STUDY_RECIPES[2], 3e-3))
    with pytest.raises(ValueError, match="are both"):  # two runs in one block's role: an error, not "no block"
        probe_targets(study, [*twice, replace(twice[0], path="elsewhere")])
    # a study in pieces probes the first seed of every cell, the claims' runs first, never the control
    every = probe_targets(study, stats((STUDY_RECIPES[2], 3e-3)), every_first_seed=True)
    assert every[:5] == probe_targets(study, stats((STUDY_RECIPES[2], 3e-3)))
    assert sorted(every) == sorted(d for r, d in zip(study.runs, run_dirs) if r.seed == 0 and r.stem != CONTROL)
    assert len(every) == 8


def test_held_out_tracks_never_reach_the_probe_that_scores_them():
    """cross_validate's probe for a fold never sees an item of that fold's tracks: with features that are
    a one-hot of the track and a class drawn per track, every held-out item gets the same logits (the
    probe only knows its training tracks), which any leak of a held-out track would break."""
    rng = np.random.default_rng(0)
    num_tracks, per_track = 9, 5
    item_track = np.repeat(np.arange(num_tracks), per_track)
    x = torch.nn.functional.one_hot(torch.from_numpy(item_track), num_tracks).float()
    y = torch.from_numpy(rng.integers(0, 3, num_tracks)[item_track])
    folds = probe_data.folds_of_tracks(num_tracks, 3, seed=0)
    logits, _ = probe_fit.cross_validate(x, y, item_track, folds, probe_fit.Task("t", "multiclass", 3))
    for fold in folds:
        held = logits[torch.from_numpy(np.isin(item_track, fold))]
        assert torch.allclose(held, held[:1].expand_as(held), rtol=0, atol=1e-6), fold
    # the same probe trained on all tracks tells them apart: the check above can fail
    leaky = probe_fit.Probe(num_tracks, 3, codes=False)
    leaky.standardise_on(x)
    leaky.fit(leaky.prepared(x), y, probe_fit.Task("t", "multiclass", 3), l2=1e-3)
    assert (leaky.predict(x).argmax(1) == y).all()


def test_probe_is_deterministic_given_the_seed(trained_run, short_rendered_tokens):
    """Two probe runs with the same seed and no cache (features extracted again, random init drawn
    again, the L2 penalty chosen again) give the same results, to the bit; another seed draws another
    random init and deals the tracks into other folds."""
    kwargs = dict(tasks=["pitch", "key"], layers=[2], baselines=["random_init"], folds=3, frame_stride=10,
                  progress=False, write=False, use_cache=False, l2_grid=[1e-1, 1e-3],  # two to choose from
                  data=str(short_rendered_tokens[1]))  # the 4 s cut of the same tracks: 16 s of audio, not 56
    a, b = (probe.probe_run(trained_run, seed=0, **kwargs) for _ in range(2))
    assert a["results"] == b["results"] and a["fold_tracks"] == b["fold_tracks"]
    first = probe_data.random_init_model(trained_run, seed=0).module.state_dict()
    other = probe_data.random_init_model(trained_run, seed=1).module.state_dict()
    assert any(not torch.equal(first[k], other[k]) for k in first)
    assert [f.tolist() for f in probe_data.folds_of_tracks(4, 3, 0)] != [f.tolist() for f in
                                                                        probe_data.folds_of_tracks(4, 3, 1)]


def test_random_init_features_are_shared_by_runs_of_one_architecture(trained_run, short_rendered_tokens, tmp_path,
                                                                     monkeypatch):
    """A run beside one already probed reads that run's cached random-init features (same architecture,
    probe seed and data) and extracts only its own model's; another probe seed, or another architecture,
    extracts its random init again."""
    runs = tmp_path / "runs"
    first, second = runs / "a", runs / "b"
    for d in (first, second):
        shutil.copytree(trained_run, d, ignore=shutil.ignore_patterns("probe"))
    kwargs = dict(tasks=["key"], layers=[2], baselines=["random_init"], folds=3, frame_stride=10,
                  progress=False, write=False, l2_grid=[0.01],  # one penalty: no choosing, a fifth of the fits
                  data=str(short_rendered_tokens[1]))  # the 4 s cut of the same tracks: 16 s of audio, not 56
    done = probe.probe_run(first, **kwargs)
    extracted: list[str] = []
    real = probe_data._extract

    def counting(data, name, *args, **kw):
        extracted.append(name)
        return real(data, name, *args, **kw)

    monkeypatch.setattr(probe_data, "_extract", counting)
    again = probe.probe_run(second, **kwargs)
    assert extracted == ["model"]
    assert again["results"]["random_init"] == done["results"]["random_init"]
    assert not list((second / "probe" / "cache").glob("random_init-*"))  # read where it is, not copied
    probe.probe_run(second, seed=1, **kwargs)
    assert extracted == ["model", "random_init"]  # the model's own features: from its cache now
    third = runs / "c"  # another model config (relax's alpha): its random init is not the first run's
    shutil.copytree(trained_run, third, ignore=shutil.ignore_patterns("probe"))
    cfg = (third / "config.yaml").read_text()
    assert "relax_alpha: 32.0" in cfg
    (third / "config.yaml").write_text(cfg.replace("relax_alpha: 32.0", "relax_alpha: 16.0"))
    probe.probe_run(third, **kwargs)
    assert extracted == ["model", "random_init", "model", "random_init"]


def test_probe_names_missing_or_mismatched_labels(trained_run, rendered_tokens, tmp_path):
    """Data whose source has no labels, or labels of other audio, are refused naming the folder or track."""
    with pytest.raises(ConfigError, match=f"tokenized from '{tmp_path}', which has no labels.jsonl: pass --labels"):
        probe_data._labels_dir_for({"source": str(tmp_path), "source_kind": "folder"}, "DATA", None)
    other = tmp_path / "other"
    build.build_corpus(other, num_tracks=1, seed=5, max_seconds=2, progress=False)
    with pytest.raises(ConfigError, match="are of a corpus with config .* not the same audio"):
        probe_data.load_probe_data(trained_run, labels=other)
    (other / "corpus.json").unlink()  # no config to compare: the tracks themselves do not match
    with pytest.raises(KeyError, match="has no labels for track '000_"):
        probe_data.load_probe_data(trained_run, labels=other)


def test_class_scorer_gives_class_metrics_of_every_resample_to_the_bit():
    """class_scorer (per-item hits and per-track predictions computed once) scores the whole data and each
    bootstrap resample of whole tracks exactly as class_metrics on the gathered logits does, for keys
    (with MIREX) and instruments."""
    rng = np.random.default_rng(0)
    item_track = np.repeat(np.arange(9), rng.integers(1, 6, 9))
    y = torch.from_numpy(rng.integers(0, 24, 9)[item_track])
    logits = torch.from_numpy(rng.normal(size=(len(y), 24)).astype(np.float32))
    logits[torch.arange(len(y)), y] += 1.5  # some items and tracks right, some wrong
    for key in (True, False):
        fast = probe_fit.class_scorer(logits, y, item_track, key)
        seen: list[dict] = []

        def both(items, groups, key=key, fast=fast, seen=seen):
            seen.append(probe_fit.class_metrics(logits[items], y[items], groups, key))
            assert fast(items, groups) == seen[-1]
            return seen[-1]

        assert both(np.arange(len(y)), item_track)["accuracy"] >= 0
        probe_fit.bootstrap(both, item_track, seed=0, resamples=50)
        assert len({d["track_accuracy"] for d in seen}) > 1 and ("mirex" in seen[0]) == key  # resamples differ


def test_average_precision_and_mirex_score():
    """AP matches a hand computation (weights count items that many times); MIREX key credits are 1 / 0.5 /
    0.3 / 0.2 / 0; folds of tracks are a seeded partition."""
    scores = torch.tensor([[0.9], [0.8], [0.7], [0.1]])
    labels = torch.tensor([[1.0], [0.0], [1.0], [0.0]])
    assert probe_fit.average_precision(scores, labels).item() == pytest.approx((1 + 2 / 3) / 2)
    twice = probe_fit.average_precision(scores, labels, torch.tensor([1, 2, 1, 0]))
    dup = probe_fit.average_precision(torch.tensor([[0.9], [0.8], [0.8], [0.7]]), torch.tensor([[1.0], [0], [0], [1]]))
    assert twice.item() == pytest.approx(dup.item()) == pytest.approx((1 + 2 / 4) / 2)
    # C major (0) vs: C major, G major (7), A minor (12 + 9), C minor (12), D major (2)
    truth = np.zeros(5, dtype=np.int64)
    assert probe_fit.mirex_key_score(np.array([0, 7, 21, 12, 2]), truth).tolist() == [1.0, 0.5, 0.3, 0.2, 0.0]
    assert probe_fit.mirex_key_score(np.array([0, 16]), np.array([21, 21])).tolist() == [0.3, 0.5]  # A minor: C, E minor
    folds = probe_data.folds_of_tracks(10, 4, seed=3)
    assert sorted(np.concatenate(folds).tolist()) == list(range(10)) and [len(f) for f in folds] == [3, 3, 2, 2]
    assert all(np.array_equal(a, b) for a, b in zip(folds, probe_data.folds_of_tracks(10, 4, seed=3)))
    with pytest.raises(ValueError, match="folds must be >= 3"):
        probe_data.folds_of_tracks(10, 2, seed=0)
