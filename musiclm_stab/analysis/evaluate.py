"""Held-out evaluation: acoustic loss and accuracy per codebook (codebook 0 first), musical loss, total.

    musiclm-stab evaluate RUN_DIR_OR_CHECKPOINT [--data TOKENIZED] [--split eval|train|all]

Deterministic: centre crops, no noise mixup, span masks from a fixed seed (trimmed to one count per batch
when the run's ``model.require_same_masks`` is on, as in training), dropout off; two evaluations of one
checkpoint agree exactly. Losses are averaged over masked frames of the whole split, in the run's
``train.loss_unit`` (bits, or nats for runs made before the setting existed), which the results name
under ``unit``. Results are printed as a table and written to the run directory under the metric names of
DESIGN.md with the ``eval/`` prefix: ``<run>/eval/step_<N>.json`` for the held-out split of the run's own data,
a file of its own for any other split or data (``training.run_dir.eval_record``), so that evaluating the train
split never replaces the held-out record the model card reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.loading import config_from_run
from musiclm_stab.data import CropDataset, split_indices
from musiclm_stab.data.loader import EVAL_BATCH_SIZE, EVAL_SEED, held_out_loader
from musiclm_stab.host import default_device
from musiclm_stab.training.checkpoint import STATE_FILE
from musiclm_stab.training.held_out import held_out_metrics
from musiclm_stab.training.precision import forward_context
from musiclm_stab.training.run_dir import eval_record, read_run_json
from musiclm_stab.training.trained import load_model, resolve_checkpoint


# no_grad, not inference_mode: under inference_mode torch dispatches some operations differently, and an fp16
# run's emulated arithmetic (model/fp16_arith.py) then rounds at other points than the trainer's evaluation did
@torch.no_grad()
def evaluate(path: str | Path, data: str | list[str] | None = None, split: str = "eval",
             batch_size: int = EVAL_BATCH_SIZE, seed: int = EVAL_SEED, device: str | None = None,
             write: bool = True) -> dict:
    """Evaluate a run or checkpoint; returns {"eval/<metric>": value, ...} plus provenance keys. ``device``:
    CUDA when there is one, unless given (host.default_device)."""
    from musiclm_stab.data.tokenized import check_same_tokenizer, load_tokenized

    run_dir, ckpt = resolve_checkpoint(path)
    cfg = config_from_run(run_dir)
    data_path = data or cfg.data.path
    hf, info = load_tokenized(data_path)
    run_tok = run_dir / "tokenizer.json"
    if run_tok.is_file():
        check_same_tokenizer(read_run_json(run_tok), info, f"run {run_dir}", f"data {data_path}")
    train_idx, eval_idx = split_indices(hf["track"], cfg.data.eval_fraction)
    indices = {"eval": eval_idx, "train": train_idx, "all": sorted(train_idx + eval_idx)}.get(split)
    if indices is None:
        raise ConfigError(f"split={split!r} is not valid; choose one of: eval, train, all")
    dataset = CropDataset(hf, indices, cfg.data.crop_seconds, seed=seed, random_crop=False)
    if len(dataset) == 0:
        raise ConfigError(f"the {split!r} split of {data_path} has no segment of at least "
                          f"{cfg.data.crop_seconds} s (eval_fraction={cfg.data.eval_fraction}); try --split all")
    device = default_device(device)
    model = load_model(ckpt, cfg, device)
    # The loop train.eval_every shares (training/held_out.py): losses averaged over masked frames.
    # in the run's precision (fp16 runs: the fp16 arithmetic, emulated on CPU), as train.eval_every computes it
    result, frames = held_out_metrics(model, held_out_loader(cfg, dataset, batch_size, seed), cfg.model.resolved(),
                                      cfg.train.loss_unit, device, progress=True,
                                      forward_context=lambda: forward_context(cfg.train, device))
    step = json.loads((ckpt / STATE_FILE).read_text())["step"]
    result.update({"step": step, "checkpoint": str(ckpt),
                   "data": [str(d) for d in data_path] if isinstance(data_path, list) else str(data_path),
                   "split": split, "unit": cfg.train.loss_unit,
                   "num_segments": len(dataset), "masked_frames": frames, "seed": seed})
    if write:
        write_result(result)
    return result


class EvaluationWriteError(RuntimeError):
    """The results could not be written into the run directory (it is read-only, the disk is full, ...)."""


def write_result(result: dict) -> Path:
    """Write ``evaluate``'s result to its record in the run directory (``eval_record``: one per split and data;
    complete or absent); EvaluationWriteError naming the file and the reason if it cannot be."""
    ckpt = Path(result["checkpoint"])
    run_dir = ckpt.parent.parent
    out = eval_record(run_dir, result["step"], result["split"], result["data"], config_from_run(run_dir).data.path)
    part = out.with_name(f".{out.name}.part")
    try:
        out.parent.mkdir(exist_ok=True)
        part.write_text(json.dumps(result, indent=2))
        os.replace(part, out)
    except OSError as e:
        raise EvaluationWriteError(f"evaluated {ckpt}, but could not write {out}: {e.strerror or e}") from e
    return out


def format_table(result: dict) -> str:
    K = sum(1 for k in result if k.startswith("eval/acoustic_mlm_loss/cb"))
    lines = [f"evaluation of {result['checkpoint']} (step {result['step']}) on {result['split']} split of "
             f"{result['data']}: {result['num_segments']} segments, {result['masked_frames']} masked frames",
             f"{'codebook':>10} {'loss':>9} {'acc':>7}   (losses in {result.get('unit', 'nats')})"]
    for k in range(K):
        lines.append(f"{'cb' + str(k):>10} {result[f'eval/acoustic_mlm_loss/cb{k}']:9.4f} "
                     f"{result[f'eval/acoustic_acc/cb{k}']:7.3f}")
    lines += [f"{'acoustic':>10} {result['eval/acoustic_mlm_loss']:9.4f}",
              f"{'musical':>10} {result['eval/musical_mlm_loss']:9.4f}",
              f"{'feat_pen':>10} {result['eval/features_pen']:9.4f}",
              f"{'total':>10} {result['eval/loss']:9.4f}"]
    return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="musiclm-stab evaluate", description=__doc__.split("\n\n")[0],
                                epilog="Reference: docs/TRAINING.md (offline: musiclm-stab docs TRAINING)")
    p.add_argument("path", help="run directory (newest checkpoint) or a checkpoint directory")
    p.add_argument("--data", nargs="+", help="tokenized dataset, or several folders (e.g. shards), after "
                   "PATH (default: the run's data.path)")
    p.add_argument("--split", default="eval", choices=["eval", "train", "all"])
    p.add_argument("--batch-size", type=int, default=EVAL_BATCH_SIZE)
    p.add_argument("--seed", type=int, default=EVAL_SEED, help="seed of the evaluation masks")
    p.add_argument("--device", help="where to run the model (default: cuda when there is a GPU, else cpu)")
    args = p.parse_args(argv)
    try:
        data = args.data[0] if args.data and len(args.data) == 1 else args.data
        result = evaluate(args.path, data, args.split, args.batch_size, args.seed, args.device, write=False)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))  # shown even if it cannot be written
    try:
        write_result(result)
    except EvaluationWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
