"""Which codes a study's runs trained on, as its folder's ``data.json`` records them: read here, where the
claims (analysis/claims.py) and the study (experiments/study_codes.py, which writes the record) both reach.

``data.json`` holds the sha256 of the codes the study's runs train on (``codes_sha256``) and, after a declared
switch of codes (``musiclm-stab study --switch-codes``), under ``earlier_codes`` each earlier codes sha256 with
the runs that trained on them.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA_RECORD = "data.json"
RUN_TIME_FILE = "study_time.json"  # written for each finished run (experiments/study.py)


def read_record(folder: str | Path) -> dict | None:
    """FOLDER/data.json, or None when there is none."""
    record = Path(folder) / DATA_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def codes_of(record: dict, name: str) -> str | None:
    """The codes sha256 run ``name`` trained on, by ``record`` (a data.json): that of the earlier codes that
    list it, else the recorded codes."""
    for earlier in record.get("earlier_codes", []):
        if name in earlier.get("runs", []):
            return earlier.get("codes_sha256")
    return record.get("codes_sha256")


def run_codes_sha256(run_dir: str | Path) -> str | None:
    """The codes sha256 the run in ``run_dir`` trained on, by its study folder's data.json (None: no record)."""
    record = read_record(Path(run_dir).parent)
    return None if record is None else codes_of(record, Path(run_dir).name)
