"""The run directory: refusing what must not happen to one, writing its config, and its metrics rows."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from musiclm_stab.config import Config, ConfigError, config_from_run, save_config


class MetricsWriter:
    """Appends one JSON row per logged step to metrics.jsonl (main process only)."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, row: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")


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
            check_same_tokenizer(json.loads(old_tok.read_text()), tokenizer_info, f"run {run_dir}",
                                 f"data {cfg.data.path}")


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


def write_run_dir(cfg: Config, tokenizer_info: dict, num_processes: int = 1) -> Path:
    run_dir = cfg.run_dir
    saved_cfg = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    save_config(cfg, saved_cfg, comment=f"launched with {global_batch(cfg, num_processes)}")
    (run_dir / "tokenizer.json").write_text(json.dumps(tokenizer_info, indent=2))
    return run_dir
