"""The run directory: one trainer at a time in it, refusing what must not happen to one, writing its
config, and its metrics rows.

One writer per run directory: ``RunLock``, an OS record lock (``fcntl.lockf``) on ``<run>/.train.lock``
held by the job's main process from before the directory is checked until the run ends, as the tokenizer
holds its output's (tokenizer/lock.py). A second trainer on the same directory (a requeued job while the
old one still runs, the same command twice) is refused with the holder's pid and command and exit 2,
instead of interleaving metrics rows and checkpoint writes. The kernel releases the lock when the holder
exits, however it dies (kill -9 included), so a ``--resume`` after a crash is never refused; a record lock
is not inherited by the data loader's forked workers either. Under several processes only the main process
(rank 0) takes it, since it alone writes the run directory's files (config, metrics, manifests and
renames; the others write only their part of a checkpoint's ``.tmp-step_N``, which the main process
publishes), and tells the others whether it got it (``lock_run_dir``, a broadcast), so every process of a
refused job stops with the same message. A fresh run's config.yaml is created atomically (``os.link`` of
a complete file, which fails if the name exists), so two fresh launches cannot both claim the directory
even where locks do not work (some network file systems).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
from pathlib import Path

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import config_from_run, save_config
from musiclm_stab.config.sections import Config
from musiclm_stab.durable import fsync_dir, fsync_file
from musiclm_stab.locks import WRITERS, Held, writer_lock
from musiclm_stab.removal import discard_temporary, move_tail_aside

LOCK_FILE = WRITERS["train"]


class RunBusy(ConfigError):
    """Another trainer is writing the same run directory."""


class MetricsWriteError(RuntimeError):
    """A metrics row could not be appended (e.g. the disk is full); metrics.jsonl is left as it was."""


def _os_error(run_dir: Path, error: OSError, doing: str) -> ConfigError:
    """A run directory that cannot be made or written (train.output_dir under a file, no permission, ...)."""
    return ConfigError(f"train.output_dir: cannot {doing} {run_dir}: {error.strerror or error}"
                       + (f" ({error.filename})" if error.filename and str(error.filename) != str(run_dir) else ""))


class RunLockLost(RunBusy):
    """This trainer's lock file was deleted or replaced while it trained: another trainer may hold the new one."""


class RunLock:
    """The exclusive lock of one run directory (module docstring; musiclm_stab/locks.py), taken at
    construction: RunBusy if another process (or another RunLock of this process) holds it, or a tokenizer
    is writing into the same folder; ConfigError if the directory cannot be made. ``check`` (before every
    write) stops a trainer whose lock file was deleted or replaced; ``release`` (or the process's exit)
    frees it."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        path = self.run_dir / LOCK_FILE
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _os_error(self.run_dir, e, "create the run directory") from None
        try:
            self.lock = writer_lock(self.run_dir, "train")
        except Held as e:
            doing = "trained" if e.path == path else "written"  # a tokenizer's output being written there
            if e.this_process:
                raise RunBusy(f"run directory {self.run_dir} is being {doing} by {e.holder} (this process)") from None
            raise RunBusy(f"run directory {self.run_dir} is being {doing} by {e.holder}; wait for it to finish "
                          f"or stop it (its lock, {e.path}, is released when that process exits), or choose "
                          "another --train.name") from None
        except OSError as e:
            raise _os_error(self.run_dir, e, "lock") from None
        try:
            self.lock.write_holder()
        except OSError:  # only the refusal message of another trainer reads it ("another process")
            pass

    def check(self, doing: str) -> None:
        """RunLockLost if the lock file was deleted or replaced since it was taken: another trainer may have
        locked the new file and be writing the run, so this one must write nothing more (``doing``: what it
        was about to write)."""
        lost = self.lock.lost()
        if lost is not None:
            raise RunLockLost(
                f"the lock of run directory {self.run_dir} ({self.lock.path}) was {lost} while this trainer "
                f"held it, so another trainer may be writing the run now: stopped before {doing}, without "
                "writing anything more. A lock file is never to be deleted: it is released when its process "
                "exits, however that process ends. Once no other trainer runs in the directory, resume with "
                "the same command and --resume.")

    def release(self) -> None:
        self.lock.release()


def on_main(accelerator, action, *args):
    """``action(*args)`` on the main process, its result returned there (None elsewhere); a ConfigError it
    raises is raised on every process, with the same message and class (RunBusy or ConfigError), instead of
    leaving the other processes at the next barrier. A collective under several processes."""
    from accelerate.utils import broadcast_object_list

    result, problem = None, [None, None]
    if accelerator.is_main_process:
        try:
            result = action(*args)
        except ConfigError as e:
            problem = [str(e), isinstance(e, RunBusy)]
    if accelerator.num_processes > 1:
        broadcast_object_list(problem, from_process=0)
    if problem[0] is not None:
        raise (RunBusy if problem[1] else ConfigError)(problem[0])
    return result


def check_run_lock(accelerator, lock: RunLock | None, doing: str) -> None:
    """``lock.check(doing)`` on the main process (which holds the run's lock; ``lock`` is None elsewhere), its
    RunLockLost raised on every process as RunBusy (a collective: every process stops together)."""
    on_main(accelerator, lambda: lock.check(doing))


def lock_run_dir(accelerator, run_dir: Path) -> RunLock | None:
    """The run directory's lock, taken by the main process (None on the others); every process raises the
    same RunBusy (or ConfigError) when it could not be taken."""
    return on_main(accelerator, RunLock, run_dir)


class MetricsWriter:
    """Appends one JSON row per logged step to metrics.jsonl (main process only). A row that cannot be
    written whole (a full disk) is taken back, so the file never holds a partial line, and the run stops
    with MetricsWriteError. ``lock``, the run's: checked before every row (``RunLock.check``), so that a
    trainer whose lock was taken from it adds no row beside another's."""

    def __init__(self, path: Path, enabled: bool, lock: RunLock | None = None):
        self.path, self.enabled, self.lock = path, enabled, lock

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.lock is not None:
            self.lock.check(f"the metrics row of step {row.get('step')}")
        line = (json.dumps(row) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise MetricsWriteError(f"could not open {self.path}: {e.strerror or e}") from e
        try:
            size = os.fstat(fd).st_size
            try:
                done = 0
                while done < len(line):  # a short write is followed by the one that fails with the reason
                    written = os.write(fd, line[done:])
                    if written == 0:
                        raise OSError(errno.EIO, f"wrote {done} of {len(line)} bytes")
                    done += written
            except OSError as e:
                try:
                    os.ftruncate(fd, size)  # no partial row for the next append (or a resume) to follow
                except OSError:
                    pass
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                raise MetricsWriteError(
                    f"could not append the row of step {row.get('step')} to {self.path}: {e.strerror or e}; the "
                    "file is left as it was and training stops (it resumes from the newest checkpoint). "
                    + ("Free some space" if full else "Fix the cause") + ", then resume with the same command "
                    "and --resume.") from e
        finally:
            os.close(fd)


def check_run_dir(cfg: Config, resume: bool, tokenizer_info: dict) -> None:
    """Refuse to overwrite a run, to resume with another model config, or to mix tokenizers."""
    from musiclm_stab.data.tokenized import check_same_tokenizer

    run_dir = cfg.run_dir
    saved_cfg = run_dir / "config.yaml"
    if saved_cfg.exists() and not resume:
        raise ConfigError(f"run directory {run_dir} already exists; pass --resume to continue it, "
                          f"or choose another --train.name")
    if resume and saved_cfg.exists():
        old = config_from_run(run_dir).to_dict()  # settings newer than the run read back as it had them
        new = cfg.to_dict()
        changed = [k for k in new["model"] if old["model"].get(k) != new["model"][k]]
        if changed:
            raise ConfigError(f"cannot resume {run_dir} with a changed model config: {', '.join(changed)} "
                              f"differ from {saved_cfg}")
        if old["train"]["loss_unit"] != new["train"]["loss_unit"]:  # one unit per metrics.jsonl
            raise ConfigError(f"cannot resume {run_dir} with train.loss_unit={new['train']['loss_unit']}: its "
                              f"metrics are in {old['train']['loss_unit']}; pass "
                              f"--train.loss_unit={old['train']['loss_unit']}")
        old_tok = run_dir / "tokenizer.json"
        if old_tok.exists():
            check_same_tokenizer(read_run_json(old_tok), tokenizer_info, f"run {run_dir}", f"data {cfg.data.path}")


def _data_paths(data: str | Path | list | None) -> list[str]:
    """A data.path (one folder or several) as the list of its folders, resolved."""
    return [str(Path(p).resolve()) for p in (data if isinstance(data, list) else [data]) if p is not None]


def same_data(a: str | Path | list | None, b: str | Path | list | None) -> bool:
    """Whether two data.path values (as given, or as an evaluation record names them) are the same folders."""
    return bool(_data_paths(a)) and _data_paths(a) == _data_paths(b)


def eval_record(run_dir: Path, step: int, split: str, data: str | Path | list, run_data: str | Path | list) -> Path:
    """Where ``musiclm-stab evaluate`` keeps its result of ``split`` of ``data`` at ``step``, so that no
    evaluation replaces another's: ``eval/step_N.json`` for the held-out split of the run's own data
    (``run_data``: what the model card reads, and the only name earlier versions wrote, for any split),
    ``eval/step_N.<split>.json`` for another split of it, ``eval/step_N.<split>.data-<8 hex>.json`` for other
    data (a hash of its resolved folders)."""
    name = f"step_{step:08d}"
    if not same_data(data, run_data):
        name += f".{split}.data-{hashlib.sha256(json.dumps(_data_paths(data)).encode()).hexdigest()[:8]}"
    elif split != "eval":
        name += f".{split}"
    return Path(run_dir) / "eval" / f"{name}.json"


def read_run_json(path: Path) -> dict:
    """A JSON object of a run directory (its tokenizer.json); ConfigError naming the file otherwise."""
    try:
        value = json.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    except ValueError as e:  # not UTF-8, or not JSON
        raise ConfigError(f"{path}: not a JSON file: {' '.join(str(e).split())}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return value


def resolve_grad_accum(cfg: Config, num_processes: int) -> Config:
    """``cfg`` with ``train.grad_accum`` derived from ``train.global_batch_crops`` for ``num_processes``
    (unchanged when that is not set): global_batch_crops / (data.batch_size x processes), which must be whole."""
    crops = cfg.train.global_batch_crops
    if crops is None:
        return cfg
    per_step = cfg.data.batch_size * num_processes
    if crops % per_step:
        raise ConfigError(f"train.global_batch_crops={crops} is not a multiple of data.batch_size "
                          f"{cfg.data.batch_size} x {num_processes} process(es) = {per_step}: choose a batch size "
                          "and process count whose product divides it")
    if cfg.train.grad_accum not in (1, crops // per_step):
        raise ConfigError(f"train.grad_accum={cfg.train.grad_accum} and train.global_batch_crops={crops} both set: "
                          f"the global batch fixes grad_accum ({crops // per_step} here); set only one")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=crops // per_step))


def warmup_line(cfg: Config, num_processes: int) -> str:
    """The warmup in updates and in crops (at this global batch), and the run length."""
    crops = global_batch_crops(cfg, num_processes)
    return (f"warmup {cfg.optim.warmup_steps} updates = {cfg.optim.warmup_steps * crops:,} crops, "
            f"lr {cfg.optim.lr:g} decaying to 0 at step {cfg.train.max_steps}"
            + (f", stopping at step {cfg.train.stop_at}" if cfg.train.stop_at else ""))


def global_batch_crops(cfg: Config, num_processes: int) -> int:
    """Crops in one optimizer update, over all processes and accumulated micro-batches."""
    return cfg.data.batch_size * cfg.train.grad_accum * num_processes


def global_batch(cfg: Config, num_processes: int) -> str:
    """One line stating the global batch (one optimizer update) in crops and audio-seconds."""
    crops = global_batch_crops(cfg, num_processes)
    return (f"global batch {crops} crops = {crops * cfg.data.crop_seconds:g} audio-s per update "
            f"(data.batch_size {cfg.data.batch_size} x train.grad_accum {cfg.train.grad_accum} x "
            f"{num_processes} process(es) x data.crop_seconds {cfg.data.crop_seconds:g})")


def write_run_dir(cfg: Config, tokenizer_info: dict, num_processes: int = 1, resume: bool = False) -> Path:
    """Write the run's config.yaml and tokenizer.json (main process, under the run's lock), each complete
    or absent. A fresh run (not ``resume``) creates config.yaml atomically and is refused if it exists
    meanwhile; ``resume`` replaces it (its model settings were checked to be the same: check_run_dir).
    ConfigError for a directory that cannot be written."""
    run_dir = cfg.run_dir
    saved_cfg = run_dir / "config.yaml"
    part = run_dir / f".config.yaml.{os.getpid()}.part"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*run_dir.glob(".config.yaml.*.part"), *run_dir.glob(".tokenizer.json.*.part")]:
            discard_temporary(stale)  # left by a trainer killed while writing them (this one holds the run's lock)
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        save_config(cfg, part, comment=f"launched with {global_batch(cfg, num_processes)}")
        fsync_file(part)
        if resume:
            os.replace(part, saved_cfg)
        else:
            try:
                _create(part, saved_cfg)
            except FileExistsError:
                raise ConfigError(f"run directory {run_dir} already exists; pass --resume to continue it, "
                                  f"or choose another --train.name") from None
            finally:
                discard_temporary(part)
        tok = run_dir / f".tokenizer.json.{os.getpid()}.part"
        tok.write_text(json.dumps(tokenizer_info, indent=2))
        fsync_file(tok)
        os.replace(tok, run_dir / "tokenizer.json")
        fsync_dir(run_dir)
    except OSError as e:
        discard_temporary(part, ignore_errors=True)
        raise _os_error(run_dir, e, "write the run directory") from None
    return run_dir


def _create(part: Path, path: Path) -> None:
    """``path`` with the contents of the complete file ``part``, created atomically: FileExistsError if
    ``path`` exists. A hard link (complete or absent); where the file system has none, an exclusive create
    and a copy (the name is still claimed by one process only)."""
    try:
        os.link(part, path)
        return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(part.read_bytes())
        f.flush()
        os.fsync(f.fileno())


def rewind_metrics(path: Path, step: int) -> Path | None:
    """Before a resumed run logs the steps after its checkpoint ``step`` again: move the rows of
    metrics.jsonl that the stopped run logged after that checkpoint (from the end back to the last row at or
    before ``step``; a partial last line too) to ``metrics.jsonl.aside-<time>`` (removal.move_tail_aside), so
    that no step is in the file twice; returns that file (None: nothing to move)."""
    if not path.is_file():
        return None
    data = path.read_bytes()
    offset = len(data)
    for line in reversed(data.splitlines(keepends=True)):
        try:
            logged = json.loads(line).get("step") if line.endswith(b"\n") else None
        except (ValueError, AttributeError):
            logged = None
        if isinstance(logged, int) and not isinstance(logged, bool) and logged <= step:
            break
        offset -= len(line)
    return move_tail_aside(path, offset)
