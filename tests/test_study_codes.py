"""A study's record of the codes its runs trained on (data.json): the check, a declared switch to other codes
(the earlier codes and their runs kept), carrying runs between folders, and what the summary and the claims
table say of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from musiclm_stab.analysis.claims import codes_lines, run_codes
from musiclm_stab.config import ConfigError
from musiclm_stab.data.tokenized import codes_sha256
from musiclm_stab.experiments.study import carry_study, cli_main
from musiclm_stab.experiments.study_codes import check_study_data, codes_of, merge_records, switch_codes


def _run(folder: Path, name: str, finished: bool = True) -> Path:
    run = folder / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"train:\n  name: {name}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "tokenizer.json").write_text("{}")
    if finished:
        (run / "study_time.json").write_text('{"wall_s": 1.0, "jobs": 1}')
    return run


def test_switch_keeps_the_earlier_codes_and_their_runs(other_machine_tokens, tokenized_dataset, tmp_path):
    """The study goes on with other codes only by a declared switch: data.json then names the new codes and
    keeps the earlier ones with the finished runs that trained on them and the reason; check_study_data
    accepts the new codes and refuses the earlier; a second switch lists only the runs since the first."""
    _, other = other_machine_tokens  # the same rows as tokenized_dataset, other codes
    new = codes_sha256(other)
    folder = tmp_path / "study"
    with pytest.raises(ConfigError, match="no data.json"):
        switch_codes(folder, other, "the machine that made them is gone")
    folder.mkdir()
    (folder / "data.json").write_text(json.dumps({"data": "elsewhere", "codes_sha256": "7" * 64}))
    with pytest.raises(ConfigError, match="holds no finished run"):
        switch_codes(folder, other, "gone")
    _run(folder, "a_s0"), _run(folder, "b_s0"), _run(folder, "c_s0", finished=False)
    with pytest.raises(ConfigError, match="reason"):
        switch_codes(folder, other, "  ")
    with pytest.raises(ConfigError, match="codes sha256"):
        check_study_data(folder, other)
    record = switch_codes(folder, other, "the machine that made them is gone")
    assert json.loads((folder / "data.json").read_text()) == record
    assert record["codes_sha256"] == new and record["data"] == str(other)
    [earlier] = record["earlier_codes"]
    assert earlier["codes_sha256"] == "7" * 64 and earlier["runs"] == ["a_s0", "b_s0"]
    assert earlier["why"] == "the machine that made them is gone" and earlier["machine"]["cpu"]
    assert check_study_data(folder, other) == new  # the pieces from now on
    assert [codes_of(record, n) for n in ("a_s0", "c_s0", "d_s0")] == ["7" * 64, new, new]
    with pytest.raises(ConfigError, match="nothing to switch"):
        switch_codes(folder, other, "again")
    with pytest.raises(ConfigError, match="on the recorded codes"):  # no run trained on `new` yet
        switch_codes(folder, tokenized_dataset, "back")
    (folder / "c_s0" / "study_time.json").write_text('{"wall_s": 1.0, "jobs": 1}')
    back = switch_codes(folder, tokenized_dataset, "back")
    assert [e["runs"] for e in back["earlier_codes"]] == [["a_s0", "b_s0"], ["c_s0"]]
    assert [codes_of(back, n) for n in ("a_s0", "c_s0", "d_s0")] == ["7" * 64, new, codes_sha256(tokenized_dataset)]


def test_carry_keeps_the_history_of_the_study_it_joins(tmp_path, capsys):
    """A piece's folder holds only the current codes (data.json copied before the switch, or written by the
    piece itself); carried into the study's folder, whose data.json holds the switch, the history stays."""
    piece, dest = tmp_path / "piece", tmp_path / "dest"
    _run(piece, "d_s0")
    (piece / "data.json").write_text(json.dumps({"data": "here", "codes_sha256": "e" * 64}))
    history = {"data": "there", "codes_sha256": "e" * 64,
               "earlier_codes": [{"codes_sha256": "7" * 64, "runs": ["a_s0"], "why": "gone"}]}
    dest.mkdir()
    (dest / "data.json").write_text(json.dumps(history))
    carry_study(piece, dest)
    assert json.loads((dest / "data.json").read_text()) == history
    assert (dest / "d_s0" / "metrics.jsonl").is_file()
    (piece / "data.json").write_text(json.dumps({**history, "earlier_codes": [
        {"codes_sha256": "8" * 64, "runs": ["a_s0"], "why": "other"}]}))
    with pytest.raises(ConfigError, match="different earlier codes"):
        carry_study(piece, dest)


def test_merge_records_takes_the_history_that_continues_the_other(tmp_path):
    e1, e2 = {"codes_sha256": "1" * 64, "runs": ["a"]}, {"codes_sha256": "2" * 64, "runs": ["b"]}
    now = {"codes_sha256": "3" * 64}
    assert merge_records(now, None, tmp_path) == now
    longer = {**now, "earlier_codes": [e1, e2]}
    assert merge_records({**now, "earlier_codes": [e1]}, longer, tmp_path) == longer
    assert merge_records(longer, {**now, "earlier_codes": [e1]}, tmp_path) == longer
    with pytest.raises(ConfigError, match="runs on other codes"):
        merge_records(now, {"codes_sha256": "4" * 64}, tmp_path)
    with pytest.raises(ConfigError, match="different earlier codes"):
        merge_records({**now, "earlier_codes": [e2]}, {**now, "earlier_codes": [e1]}, tmp_path)


def test_switch_codes_from_the_command_line(other_machine_tokens, tokenized_dataset, tmp_path, capsys):
    _, other = other_machine_tokens
    original = tokenized_dataset
    runs = tmp_path / "runs"
    folder = runs / "s"
    _run(folder, "a_s0")
    (folder / "data.json").write_text(json.dumps({"data": "x", "codes_sha256": codes_sha256(original)}))
    argv = ["--scale", "gpu", "--runs", str(runs), "--name", "s", "--data", str(other)]
    with pytest.raises(SystemExit):
        cli_main([*argv, "--switch-codes", "gone", "--print-only"])
    assert "trains nothing" in capsys.readouterr().err
    assert cli_main([*argv, "--switch-codes", ""]) == 2
    assert "reason" in capsys.readouterr().err
    assert cli_main([*argv, "--switch-codes", "gone"]) == 0
    out = capsys.readouterr().out
    assert codes_sha256(other) in out and "1 finished runs trained on " + codes_sha256(original) in out
    assert json.loads((folder / "data.json").read_text())["earlier_codes"][0]["runs"] == ["a_s0"]


def test_claims_name_the_codes_of_each_block_when_there_are_two(tmp_path):
    """run_codes reads each run's codes from its folder's data.json; the claims table names the blocks of
    each set of codes only when there is more than one."""
    folder = tmp_path / "study"
    for name in ("x_s0", "x_s1"):
        _run(folder, name)
    (folder / "data.json").write_text(json.dumps({"codes_sha256": "e" * 64, "earlier_codes": [
        {"codes_sha256": "7" * 64, "runs": ["x_s0"]}]}))
    lone = _run(tmp_path / "alone", "y_s0")
    codes = run_codes([folder / "x_s0", folder / "x_s1", lone])
    assert codes == {str(folder / "x_s0"): "7" * 64, str(folder / "x_s1"): "e" * 64}
    assert codes_lines({(3e-3, 0): ["7" * 64], (3e-3, 1): ["7" * 64]}) == []
    [line] = codes_lines({(3e-3, 0): ["7" * 64], (1e-3, 0): ["e" * 64], (1e-2, 0): ["7" * 64, "e" * 64]})
    assert "`77777777…`: lr 3e-3 seed 0" in line and "`eeeeeeee…`: lr 1e-3 seed 0" in line
    assert "`77777777…` and `eeeeeeee…`: lr 1e-2 seed 0" in line
