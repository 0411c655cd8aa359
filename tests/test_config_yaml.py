"""Settings files that are not valid YAML, or valid YAML that must not be a settings file: one line
`error: <file>: <reason>` and exit 2, for a recipe (--config) and for a run's config.yaml read back by
evaluate, --resume, export and features; a YAML alias bomb is refused at once, and every message that
quotes a value stays short."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from musiclm_stab.config import ConfigError, load_config, save_config

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "recipes" / "tiny.yaml"

# name -> (file bytes, what the one-line reason says)
BAD_FILES = {
    "syntax": (b"train:\n  max_steps: [1, 2\n", "line 3, column 1: expected ',' or ']', but got '<stream end>'"),
    "tab": (b"train:\n\tmax_steps: 2\n", "line 2, column 1: found character '\\t' that cannot start any token"),
    "python_tag": (b"train:\n  name: !!python/object/apply:os.system ['echo ran']\n",
                   "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"),
    "not_utf8": (b"train:\n  name: caf\xe9\n", "not UTF-8 text: byte 0xe9 at offset 18 cannot be decoded"),
    # the offset in the file, byte-order mark included (before: 18, counted after the mark)
    "not_utf8_after_a_bom": (b"\xef\xbb\xbftrain:\n  name: caf\xe9\n",
                             "not UTF-8 text: byte 0xe9 at offset 21 cannot be decoded"),
    "duplicate_key": (b"optim:\n  lr: 1.0e-3\n  lr: 1.0e-2\n", "line 3, column 3: found duplicate key 'lr' "
                                                              "(first on line 2)"),
    "duplicate_section": (b"optim:\n  lr: 1.0e-3\noptim:\n  eps: 1.0e-8\n", "line 3, column 1: found duplicate "
                                                                          "key 'optim' (first on line 1)"),
}


def alias_bomb(levels: int) -> str:
    """A recipe whose `model.size` is 9**levels strings, made of `levels` short lines of aliases (9 levels:
    387 million strings from ~320 bytes, as the issue's 301-byte file)."""
    names = "abcdefghijklmnop"
    lines = [f"a: &a [{','.join('x' * 9)}]"]
    lines += [f"{names[i]}: &{names[i]} [{','.join(['*' + names[i - 1]] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nmodel:\n  size: *{names[levels - 1]}\n"


@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_bad_recipe_is_one_line_naming_the_file(tmp_path, capsys, kind):
    """--config with a YAML syntax error, a tab, a !!python tag, bytes that are not UTF-8 or a key given twice:
    exit 2 and one line `error: <file>: <reason>` (before: a traceback, or for a key given twice the last
    value, silently), and nothing runs (the tag's command is not executed)."""
    from musiclm_stab.training.trainer import main

    data, reason = BAD_FILES[kind]
    recipe = tmp_path / f"{kind}.yaml"
    recipe.write_bytes(data)
    assert main(["--config", str(recipe), f"--train.output_dir={tmp_path / 'runs'}"]) == 2
    out = capsys.readouterr()
    assert out.err.startswith(f"error: {recipe}: ") and out.err.count("\n") == 1, out.err
    assert reason in out.err, out.err
    assert "ran" not in out.out and not (tmp_path / "runs").exists()


def fake_run(tmp_path: Path, config: bytes) -> Path:
    """A run directory with an intact (empty) checkpoint and the given config.yaml: what reading a run's
    config.yaml sees, without training one."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "files": {}}))
    (run / "config.yaml").write_bytes(config)
    return run


@pytest.mark.parametrize("kind", ["syntax", "tab", "python_tag", "not_utf8", "duplicate_key"])
@pytest.mark.parametrize("command", ["evaluate", "export", "features"])
def test_a_bad_run_config_is_one_line_for_every_command(tmp_path, capsys, command, kind):
    """evaluate, export and features given a run (or its checkpoint) whose config.yaml is not valid YAML:
    exit 2 and one line naming config.yaml (before: a traceback, or an error without the file's name)."""
    from musiclm_stab.cli import main

    data, reason = BAD_FILES[kind]
    run = fake_run(tmp_path, data)
    args = {"evaluate": [str(run)], "export": [str(run / "checkpoints" / "step_00000001"), str(tmp_path / "exp")],
            "features": [str(run), str(tmp_path), str(tmp_path / "feats")]}[command]
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'config.yaml'}: ") and err.count("\n") == 1, err[-3000:]
    assert reason in err, err


@pytest.mark.parametrize("kind", ["tab", "not_utf8"])
def test_resume_with_a_bad_run_config_is_one_line(tokenized_dataset, tmp_path, capsys, fresh_accelerate_state, kind):
    """--resume of a run whose config.yaml is not valid YAML: exit 2, one line naming it (before: a traceback)."""
    from musiclm_stab.training.trainer import main

    data, reason = BAD_FILES[kind]
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_bytes(data)
    assert main(["--config", str(TINY), f"--data.path={tokenized_dataset}", f"--train.output_dir={tmp_path}",
                 "--train.name=r", "--data.crop_seconds=2.0", "--data.batch_size=2", "--data.eval_fraction=0.3",
                 "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'r' / 'config.yaml'}: ") and reason in err, err[-3000:]
    assert (tmp_path / "r" / "config.yaml").read_bytes() == data  # left as it was


def test_an_alias_bomb_is_refused_at_once_with_a_short_message(tmp_path):
    """A recipe whose aliases expand to 531,441 strings (6 levels): refused as such, with a short message
    (before: the message quoted the whole value, 3 MB; 9 levels took 80 s and 3.6 GB)."""
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(alias_bomb(6))
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    assert len(str(e.value)) < 300, len(str(e.value))
    assert re.fullmatch(rf"{re.escape(str(recipe))}: line \d+, column \d+: its aliases expand it to more than "
                        r"10,000 values .*", str(e.value)), str(e.value)


def test_the_issues_301_byte_bomb_costs_nothing(tmp_path):
    """The issue's bomb (9 levels: 387 million strings from ~300 bytes) is refused in well under a second."""
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(alias_bomb(9))
    assert len(recipe.read_bytes()) < 400
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="its aliases expand it to more than 10,000 values"):
        load_config(recipe)
    assert time.perf_counter() - start < 2.0


def test_a_few_aliases_and_merge_keys_still_load(tmp_path):
    """Aliases and merge keys within the limit are plain YAML and load as before; a merged key may be
    overridden (only a key written twice in one mapping is refused)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim: &o\n  lr: 2.0e-3\n  betas: &b [0.9, 0.95]\ntrain:\n  max_steps: 7\n")
    cfg = load_config(recipe)
    assert cfg.optim.lr == 2e-3 and cfg.optim.betas == (0.9, 0.95)
    merged = tmp_path / "m.yaml"
    merged.write_text("optim:\n  <<: {lr: 1.0e-2, eps: 1.0e-7}\n  lr: 3.0e-3\n")
    cfg = load_config(merged)
    assert (cfg.optim.lr, cfg.optim.eps) == (3e-3, 1e-7)


@pytest.mark.parametrize("text", [
    "model:\n  size: [" + ", ".join(["verylongvalue" * 10] * 5000) + "]\n",  # a list where a string belongs
    "train:\n  max_steps: [" + ", ".join(["1"] * 9000) + "]\n",  # a list where a number belongs
    "train:\n  name: " + "n" * 200_000 + "\n  max_steps: x\n",  # a long name is fine; the message stays short
    "model:\n  size: " + "s" * 200_000 + "\n",  # a long string that is not a choice
])
def test_values_in_messages_are_truncated(tmp_path, text):
    """A value of the wrong type or a long one is quoted in a bounded form (before: in full, one number or
    string after another: up to megabytes), and the message names the setting (and the file, for a value
    of the wrong type; a value checked after every file is read is the resolved one)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    message = str(e.value)
    assert len(message) < 400, (len(message), message[:500])
    assert re.match(rf"({re.escape(str(recipe))}: )?(model\.size|train\.max_steps)", message), message
    assert message.startswith(f"{recipe}: ") or "is not valid; choose one of" in message, message


def test_a_settings_file_is_read_back_as_written(tmp_path):
    """A run's config.yaml written by save_config reads back through the strict loader unchanged."""
    from musiclm_stab.config import config_from_run

    cfg = load_config(TINY, ["--data.path=[a,b]"])
    save_config(cfg, tmp_path / "config.yaml")
    assert config_from_run(tmp_path).to_dict() == cfg.to_dict()


def test_a_settings_file_read_again_is_what_it_holds_now_and_each_caller_s_own(tmp_path):
    """read_settings_file keeps each text's parse (a study's plan reads each recipe once per run): a file read
    again gives what it holds now (rewritten in place at the same size), the values one caller changed are not
    what the next read gets, and a bad text is refused on every read, not only the first."""
    from musiclm_stab.config.settings_file import read_settings_file

    path = tmp_path / "r.yaml"
    path.write_text("optim:\n  lr: 0.001\n")
    first = read_settings_file(path)
    first["optim"]["lr"] = 5.0
    assert read_settings_file(path) == {"optim": {"lr": 0.001}}
    path.write_text("optim:\n  lr: 0.002\n")
    assert read_settings_file(path) == {"optim": {"lr": 0.002}}
    assert load_config([TINY, path]).optim.lr == 0.002
    path.write_text("optim:\n  lr: 0.001\n  lr: 0.002\n")
    for _ in range(2):
        with pytest.raises(ConfigError, match="duplicate key 'lr'"):
            read_settings_file(path)
