"""Which codes a study's runs trained on: the study folder's ``data.json``.

A study run in pieces (on several machines, or after its run directories were copied elsewhere) trains every
run on one set of codes, recorded in ``data.json`` as the sha256 of the tokenized data's codes
(``codes_sha256``); a piece on other codes is refused. Where the study's codes can no longer be had, the study
may go on with other codes as a *declared deviation* (``switch_codes``, ``musiclm-stab study --switch-codes
WHY``): ``data.json`` then keeps, under ``earlier_codes``, each earlier codes sha256 with the runs that trained
on them, when, where and why, and ``codes_of`` says for every run which codes it trained on. Reading the record
(``read_record``, ``codes_of``, ``run_codes_sha256``) lives in analysis/study_record.py, which the claims use too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from musiclm_stab.analysis.study_record import (
    DATA_RECORD,
    RUN_TIME_FILE,
    codes_of,
    read_record,
    run_codes_sha256,
)
from musiclm_stab.config.checks import ConfigError
from musiclm_stab.host import machine

__all__ = ["DATA_RECORD", "RUN_TIME_FILE", "check_study_data", "codes_of", "merge_records", "read_record",
           "run_codes_sha256", "switch_codes"]

def check_study_data(folder: Path, data: str | Path) -> str:
    """The sha256 of ``data``'s codes, checked against FOLDER/data.json, the record of the codes the study's
    runs train on (written when missing). A study run in pieces, on several machines or after its run
    directories were copied elsewhere, must train every run on the same codes: else ConfigError."""
    from musiclm_stab.data.tokenized import codes_sha256

    sha = codes_sha256(data)
    earlier = read_record(folder)
    if earlier is not None:
        if earlier.get("codes_sha256") != sha:
            here = machine()
            raise ConfigError(
                f"{data} has codes sha256 {sha}, but the runs of {folder} were trained on codes with sha256 "
                f"{earlier.get('codes_sha256')} ({earlier.get('data')}, {folder / DATA_RECORD}): tokenize the same "
                f"corpus with the same weights, or give this study another --runs / --name. The same corpus and "
                f"weights can tokenize to other codes on another CPU (float32; this one: {here['cpu']}, "
                f"{here['cpu_capability']} kernels): then put the study's codes into this tokenizing with --codes "
                f"FILE (a file made by `musiclm-stab codes save` where they were made); see docs/STUDY.md, "
                f"'In pieces'"
            )
        return sha
    folder.mkdir(parents=True, exist_ok=True)
    (folder / DATA_RECORD).write_text(json.dumps({"data": str(data), "codes_sha256": sha}, indent=1) + "\n")
    return sha


def _finished_runs(folder: Path) -> list[str]:
    return sorted(d.name for d in folder.iterdir()
                  if (d / "config.yaml").is_file() and (d / RUN_TIME_FILE).is_file())


def switch_codes(folder: str | Path, data: str | Path, why: str) -> dict:
    """Declare that the study in ``folder`` goes on with ``data``'s codes, other than the codes its runs so far
    trained on (a deviation from its plan, said before the runs it concerns: docs/STUDY.md). FOLDER/data.json
    then records ``data``'s codes, and keeps, last in ``earlier_codes``, the codes it recorded until now with
    the finished runs in ``folder`` not listed there already (the runs that trained on them), the date, this
    machine and ``why``.
    Refused (ConfigError), writing nothing: no data.json in ``folder``, no finished run in it, ``data`` with
    the codes already recorded, an empty ``why``. Returns the new record."""
    from musiclm_stab.data.tokenized import codes_sha256

    folder = Path(folder)
    record = read_record(folder)
    if record is None:
        raise ConfigError(f"{folder} has no {DATA_RECORD}: no study whose codes could be switched")
    if not why.strip():
        raise ConfigError("--switch-codes needs the reason for the deviation, in words")
    sha = codes_sha256(data)
    if sha == record.get("codes_sha256"):
        raise ConfigError(f"{data} has the codes {folder / DATA_RECORD} records already ({sha}): nothing to switch")
    listed = {name for e in record.get("earlier_codes", []) for name in e.get("runs", [])}
    runs = [name for name in _finished_runs(folder) if name not in listed]
    if not runs:
        raise ConfigError(f"{folder} holds no finished run on the recorded codes: nothing trained on them, which a new "
                          f"{DATA_RECORD} (another --runs / --name) would replace without a deviation")
    earlier = {"codes_sha256": record.get("codes_sha256"), "data": record.get("data"), "runs": runs,
               "switched_at": time.strftime("%Y-%m-%d"), "machine": machine(), "why": why.strip()}
    new = {"data": str(data), "codes_sha256": sha, "earlier_codes": [*record.get("earlier_codes", []), earlier]}
    (folder / DATA_RECORD).write_text(json.dumps(new, indent=1) + "\n")
    return new


def merge_records(ours: dict, theirs: dict | None, where: Path) -> dict:
    """The data.json of a study folder that receives runs (``theirs``, None: none yet) from one with the
    record ``ours``: the same codes or ConfigError; of two histories (``earlier_codes``, oldest first), the
    one that continues the other (a piece's own folder may hold none); two that part: ConfigError."""
    if theirs is None:
        return ours
    if theirs.get("codes_sha256") != ours.get("codes_sha256"):
        raise ConfigError(f"{where} records codes sha256 {theirs.get('codes_sha256')}, but the runs carried "
                          f"trained on {ours.get('codes_sha256')}: runs on other codes do not join that study")
    a, b = ours.get("earlier_codes", []), theirs.get("earlier_codes", [])
    if a[:len(b)] != b and b[:len(a)] != a:
        raise ConfigError(f"{where} and the study carried record different earlier codes (earlier_codes): "
                          "not merged")
    return ours if len(a) >= len(b) else theirs
