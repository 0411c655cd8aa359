"""musiclm_stab.spawned: whether spawned worker processes would run the calling script again, judged as
multiprocessing's spawn judges it (scripts run as files or with -m, not -c nor a package's __main__), from the
call's place in the script (under `if __name__ == "__main__":` or not)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROBE = "from musiclm_stab.spawned import spawn_would_rerun as check\n"


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.parametrize(("body", "expected"), [
    ("print(check())\n", "script.py:2"),  # at the top level: every worker would run it again
    ("def main():\n    print(check())\n\nmain()\n", "script.py:5"),  # a function called from the top level
    ('if __name__ == "__main__":\n    print(check())\n', "None"),
    ('def main():\n    print(check())\n\n\nif "__main__" == __name__:\n    x = 1\n    main()\n', "None"),
    ('if __name__ == "__main__":\n    pass\nprint(check())\n', "script.py:4"),  # after the guard, not in it
    ('if __name__ != "__main__":\n    pass\nelse:\n    print(check())\n', "script.py:5"),  # not the idiom: unguarded
])
def test_a_script_file_is_judged_by_where_the_call_sits(tmp_path, body, expected):
    """A script run as a file: a call at its top level, directly or through its functions, would be rerun by
    spawn (the answer names the script's line); one under `if __name__ == "__main__":` would not."""
    (tmp_path / "script.py").write_text(PROBE + body)
    out = _run(tmp_path, "script.py").stdout.strip()
    assert out == expected if expected == "None" else out.endswith(expected) and Path(out.rsplit(":", 1)[0]).is_file()


def test_python_c_and_a_packages_main_are_never_imported_again(tmp_path):
    """`python -c` (as a notebook: no file to import) and `python -m pkg` (a package's __main__, which spawn
    skips) are safe; `python -m module` is imported again by spawn, so its top level is not."""
    assert _run(tmp_path, "-c", PROBE + "print(check())").stdout.strip() == "None"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text(PROBE + "print(check())\n")
    assert _run(tmp_path, "-m", "pkg").stdout.strip() == "None"
    (tmp_path / "module.py").write_text(PROBE + "print(check())\n")
    assert _run(tmp_path, "-m", "module").stdout.strip().endswith("module.py:2")


def test_workers_for_keeps_the_workers_or_warns_once_and_uses_this_process(tmp_path):
    """workers_for: the workers asked for where spawning is safe; 0 and exactly one warning, at the script's
    line and naming the guard, where it is not; 0 workers stay 0 without a word."""
    (tmp_path / "script.py").write_text(
        "from musiclm_stab.spawned import workers_for\n"
        "print(workers_for('tokenize', 0))\n"
        "print(workers_for('tokenize', 3))\n"
        'if __name__ == "__main__":\n'
        "    print(workers_for('tokenize', 3))\n")
    proc = _run(tmp_path, "script.py")
    assert proc.stdout.split() == ["0", "0", "3"]
    lines = [line for line in proc.stderr.splitlines() if "UserWarning" in line]
    assert len(lines) == 1 and "script.py:3: UserWarning: tokenize runs in this process instead of 3 worker" in lines[0]
    assert 'if __name__ == "__main__":' in lines[0]
