"""Training reads sharded and streamed tokenized datasets as well as saved ones (one process, in-process)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from musiclm_stab.analysis.evaluate import evaluate
from musiclm_stab.config import load_config
from musiclm_stab.data.tokenized import DuplicateRows, IncompleteShards, load_tokenized
from musiclm_stab.tokenizer.merge import merge_shards
from musiclm_stab.tokenizer.pipeline import tokenize
from musiclm_stab.training.trainer import Trainer, main

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # in-process Trainers (conftest.py)


@pytest.fixture(scope="module")
def shards(tokenized_dataset, local_weights, tmp_path_factory):
    """The audio of ``tokenized_dataset`` tokenized as --shard 0/2 and 1/2 (one track per work unit),
    and those shards merged into one folder: (shard folders, merged folder)."""
    root = tmp_path_factory.mktemp("shards")
    src = tokenized_dataset.parent / "audio"  # where the fixture wrote its 3 tracks
    kw = dict(weights=str(local_weights), segment_seconds=10.0, min_seconds=1.0, progress=False, workers=0,
              part_tracks=1)
    dirs = [root / f"shard{i}" for i in range(2)]
    for i, d in enumerate(dirs):
        tokenize(src, d, shard=f"{i}/2", **kw)
    merge_shards(root / "merged", dirs)
    return dirs, root / "merged"


def run(tmp_path, name, *overrides, resume=False):
    cfg = load_config("recipes/tiny.yaml", [
        f"--train.output_dir={tmp_path}", f"--train.name={name}", "--data.crop_seconds=2.0",
        "--data.batch_size=2", "--data.eval_fraction=0.3", "--optim.warmup_steps=1", "--train.checkpoint_every=10",
        *overrides])
    return Trainer(cfg, resume=resume).run()


def rows(run_dir):
    out = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "audio_s_per_s"} for r in out]


def test_sharded_input_trains_like_the_merged_folder(shards, tmp_path):
    """data.path=[shard1,shard0] (the override syntax, shards out of order) trains on the same data as the
    merged folder: identical metrics for 2 steps. The resolved config keeps the list and states the batch."""
    (s0, s1), merged = shards
    a = run(tmp_path, "sharded", f"--data.path=[{s1},{s0}]", "--train.max_steps=2")
    b = run(tmp_path, "merged", f"--data.path={merged}", "--train.max_steps=2")
    assert [r["step"] for r in rows(a)] == [1, 2]
    assert rows(a) == rows(b)
    text = (a / "config.yaml").read_text()
    assert yaml.safe_load(text)["data"]["path"] == [str(s1), str(s0)]
    assert "# launched with global batch 2 crops = 4 audio-s per update" in text
    assert load_config(a / "config.yaml").data.path == [str(s1), str(s0)]
    # evaluation reads the shards like the merged folder: the same held-out segments, the same numbers
    on_shards, on_merged = evaluate(a, write=False), evaluate(b, write=False)
    assert on_shards["data"] == [str(s1), str(s0)] and on_merged["data"] == str(merged)
    assert {k: v for k, v in on_shards.items() if k.startswith("eval/")} == \
        {k: v for k, v in on_merged.items() if k.startswith("eval/")}


def test_folders_that_repeat_rows_are_refused(shards, tmp_path):
    """One folder twice (also through a symlink), a merged output with one of its shards, and a shard with
    a copy of itself are refused with DuplicateRows naming both folders (they loaded every row twice);
    training with such a data.path exits with code 2 and that message, before any work."""
    (s0, s1), merged = shards
    with pytest.raises(DuplicateRows, match=f"{s0} is given twice"):
        load_tokenized([s0, s1, s0])
    (tmp_path / "link").symlink_to(s0)
    with pytest.raises(DuplicateRows, match=f"{s0} is given twice .*{tmp_path / 'link'}"):
        load_tokenized([s0, tmp_path / "link", s1])
    for streaming in (False, True):
        with pytest.raises(DuplicateRows, match=f"{merged} and {s1} hold the same rows"):
            load_tokenized([merged, s1], streaming=streaming)
    shutil.copytree(s1, tmp_path / "copy")  # no shared files: caught by the work units of one tokenization
    with pytest.raises(DuplicateRows, match=rf"{s1} and {tmp_path / 'copy'} hold the same rows \(work unit \d+ of"):
        load_tokenized([s0, s1, tmp_path / "copy"])
    assert len(load_tokenized([s1, s0])[0]) == len(load_tokenized(merged)[0]) > 0  # each once: fine

    rc = main(["--config", "recipes/tiny.yaml", f"--data.path=[{merged},{s0}]", f"--train.output_dir={tmp_path / 'runs'}"])
    assert rc == 2 and not (tmp_path / "runs").exists()


def test_an_incomplete_set_of_shards_is_refused_unless_asked_for(shards, tmp_path, capsys):
    """A shard without the other shards of its tokenization is refused (IncompleteShards, naming the shard
    there and the one missing); partial_shards=True loads it, and exactly its rows; with the merged
    output a shard is a duplicate, not a completion. Training on one shard exits with code 2."""
    (s0, s1), merged = shards
    for given in ([s1], s1):
        with pytest.raises(IncompleteShards, match=rf"{s1}: shard\(s\) 1/2 of a tokenization in 2 shards, "
                                                    r"without 0/2: 1 of 2 parts"):
            load_tokenized(given)
    part, info = load_tokenized(s1, partial_shards=True)
    whole = load_tokenized([s0, s1])[0]
    assert info["shard"] == "1/2" and 0 < len(part) < len(whole)
    assert set(part["id"]) < set(whole["id"])
    rc = main(["--config", "recipes/tiny.yaml", f"--data.path={s0}", f"--train.output_dir={tmp_path / 'runs'}"])
    assert rc == 2 and "without 1/2" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_streaming_run_trains_and_resumes_exactly(tokenized_dataset, tmp_path):
    """data.streaming=true (shuffle buffer of 3 rows, 2 micro-batches per epoch): 4 steps give finite metrics,
    and a run stopped at step 3 (mid-epoch) and resumed logs exactly the metrics of the uninterrupted run."""
    common = (f"--data.path={tokenized_dataset}", "--data.streaming=true", "--data.shuffle_buffer=3",
              "--train.max_steps=4")
    full = rows(run(tmp_path, "full", *common))
    run(tmp_path, "part", *common, "--train.stop_at=3")
    part = run(tmp_path, "part", *common, resume=True)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in full)
    assert rows(part) == full
