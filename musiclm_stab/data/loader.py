"""The training loader of a run's config, and the endless stream of micro-batches that resumes exactly."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader

from musiclm_stab.config import Config, ConfigError
from musiclm_stab.data.collate import Collator
from musiclm_stab.data.crops import CropDataset, EpochSampler, split_indices
from musiclm_stab.data.streaming import StreamingCrops


def build_data(cfg: Config, accelerator: Accelerator, tokenizer_info_out: dict):
    """The training loader and the objects that take ``set_epoch``. ``data.path`` is one tokenized folder or
    several (shards are read in the order a single run wrote them). Saved data: a DataLoader that
    ``accelerator.prepare`` splits across processes. ``data.streaming``: a DataLoader over StreamingCrops,
    which does the split itself (this process's examples only), so it is not prepared."""
    from musiclm_stab.tokenize import TokenizerMismatch, load_tokenized

    dcfg = cfg.data
    try:
        hf, info = load_tokenized(dcfg.path, streaming=dcfg.streaming)
    except TokenizerMismatch:
        raise
    except (FileNotFoundError, ValueError) as e:  # missing, unfinished or not a tokenized dataset
        raise ConfigError(f"data.path: {e}") from e
    tokenizer_info_out.update(info)
    collator = Collator(dcfg, cfg.model.resolved(), seed=cfg.train.seed)
    if dcfg.streaming:
        try:
            dataset = StreamingCrops(hf, dcfg.eval_fraction, dcfg.crop_seconds, dcfg.batch_size,
                                     seed=cfg.train.seed, rank=accelerator.process_index,
                                     world_size=accelerator.num_processes, shuffle_buffer=dcfg.shuffle_buffer)
        except ValueError as e:  # a part file that is not arrow data, or lacks a column: named in e
            raise ConfigError(f"data.path: {e}") from e
        count = dataset.num_examples
    else:
        train_idx, _ = split_indices(hf["track"], dcfg.eval_fraction)
        dataset = CropDataset(hf, train_idx, dcfg.crop_seconds, seed=cfg.train.seed, random_crop=True)
        count = len(dataset)
    if dataset.num_skipped:
        accelerator.print(f"note: {dataset.num_skipped} segments shorter than the {dcfg.crop_seconds} s crop are not used")
    needed = dcfg.batch_size * accelerator.num_processes
    if count < needed:
        raise ConfigError(f"data.path={dcfg.path}: {count} training crops, fewer than one global batch "
                          f"({needed}); lower data.batch_size or data.eval_fraction, or tokenize more audio")
    # Its own generator: starting an epoch's iterator must not draw from the global RNG (dropout's), or a
    # resumed run would diverge from an uninterrupted one.
    common = dict(collate_fn=collator, num_workers=dcfg.num_workers, pin_memory=torch.cuda.is_available(),
                  generator=torch.Generator().manual_seed(cfg.train.seed))
    if dcfg.streaming:
        return DataLoader(dataset, batch_size=None, **common), (dataset, collator)
    sampler = EpochSampler(len(dataset), seed=cfg.train.seed)
    loader = DataLoader(dataset, batch_size=dcfg.batch_size, sampler=sampler, drop_last=True, **common)
    return loader, (dataset, sampler, collator)


def micro_batches(loader, epoch_objects, accelerator: Accelerator, consumed: int):
    """Endless stream of micro-batches that starts after ``consumed`` ones (exact resume)."""
    per_epoch = len(loader)
    epoch, skip = divmod(consumed, per_epoch)
    streaming = isinstance(loader.dataset, StreamingCrops)
    while True:
        for obj in epoch_objects:
            obj.set_epoch(epoch)
        if streaming:  # a plain DataLoader (not prepared): skip without decoding, place on the device here
            loader.dataset.skip = skip
            it = (send_to_device(batch, accelerator.device) for batch in loader)
        else:
            loader.set_epoch(epoch)
            it = accelerator.skip_first_batches(loader, skip) if skip else loader
        yield from it
        epoch, skip = epoch + 1, 0
