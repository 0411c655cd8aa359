"""The training loader of a run's config, the endless stream of micro-batches that resumes exactly, and the
deterministic held-out batches that ``musiclm-stab evaluate`` and ``train.eval_every`` evaluate on."""

from __future__ import annotations

import signal

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.sections import Config
from musiclm_stab.data.collate import Collator
from musiclm_stab.data.crops import CropDataset, EpochSampler, split_indices
from musiclm_stab.data.streaming import StreamingCrops

# The held-out evaluation's defaults (`musiclm-stab evaluate` and train.eval_every): the seed of its span
# masks and its batch size (with model.require_same_masks the trim depends on the batch, so both matter).
EVAL_SEED = 1234
EVAL_BATCH_SIZE = 8


def build_data(cfg: Config, accelerator: Accelerator, tokenizer_info_out: dict):
    """(training loader, the objects that take ``set_epoch``, held-out crops). ``data.path`` is one tokenized
    folder or several (shards are read in the order a single run wrote them). Saved data: a DataLoader that
    ``accelerator.prepare`` splits across processes. ``data.streaming``: a DataLoader over StreamingCrops,
    which does the split itself (this process's examples only), so it is not prepared.

    The data order (which segments, in which order, and each crop's start) is seeded by
    ``cfg.data_order_seed`` (``data.order_seed``, else ``train.seed``); noise mixup and masks (the Collator)
    by ``train.seed``. The held-out crops (centre crops of the held-out tracks, a CropDataset read from the
    saved dataset also when training streams) are built only with ``train.eval_every`` > 0, else None."""
    from musiclm_stab.data.tokenized import TokenizerMismatch, load_tokenized

    dcfg = cfg.data
    try:
        hf, info = load_tokenized(dcfg.path, streaming=dcfg.streaming)
    except TokenizerMismatch:
        raise
    except (FileNotFoundError, ValueError) as e:  # missing, unfinished or not a tokenized dataset
        raise ConfigError(f"data.path: {e}") from e
    tokenizer_info_out.update(info)
    collator = Collator(dcfg, cfg.model.resolved(), seed=cfg.train.seed)
    order = cfg.data_order_seed
    held_out = None
    if cfg.train.eval_every:
        saved = load_tokenized(dcfg.path)[0] if dcfg.streaming else hf  # memory-mapped: reads rows on demand
        held_out = CropDataset(saved, split_indices(saved["track"], dcfg.eval_fraction)[1], dcfg.crop_seconds,
                               seed=EVAL_SEED, random_crop=False)
        if len(held_out) == 0:
            raise ConfigError(f"train.eval_every={cfg.train.eval_every}: the held-out tracks of data.path="
                              f"{dcfg.path} have no segment of at least {dcfg.crop_seconds} s "
                              f"(data.eval_fraction={dcfg.eval_fraction})")
    if dcfg.streaming:
        try:
            dataset = StreamingCrops(hf, dcfg.eval_fraction, dcfg.crop_seconds, dcfg.batch_size,
                                     seed=order, rank=accelerator.process_index,
                                     world_size=accelerator.num_processes, shuffle_buffer=dcfg.shuffle_buffer)
        except ValueError as e:  # a part file that is not arrow data, or lacks a column: named in e
            raise ConfigError(f"data.path: {e}") from e
        count = dataset.num_examples
    else:
        train_idx, _ = split_indices(hf["track"], dcfg.eval_fraction)
        dataset = CropDataset(hf, train_idx, dcfg.crop_seconds, seed=order, random_crop=True)
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
                  generator=torch.Generator().manual_seed(cfg.train.seed), worker_init_fn=ignore_stop_signals)
    if dcfg.streaming:
        return DataLoader(dataset, batch_size=None, **common), (dataset, collator), held_out
    sampler = EpochSampler(len(dataset), seed=order)
    loader = DataLoader(dataset, batch_size=dcfg.batch_size, sampler=sampler, drop_last=True, **common)
    return loader, (dataset, sampler, collator), held_out


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # the graceful stop's (training/stop.py)


def ignore_stop_signals(worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGINT. Schedulers, `timeout` and Ctrl-C signal the whole process
    group, and a worker killed mid-step makes torch raise in the trainer ('DataLoader worker ... killed by
    signal') before its graceful stop can checkpoint. The trainer stops after its step; the workers end with
    it (torch's workers exit when their parent is gone). The workers start with these signals blocked
    (``started``), so one sent while a worker starts is dropped here, not fatal before this runs."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def started(batches):
    """``batches`` iterated with its first item fetched while SIGTERM and SIGINT are blocked in this thread:
    the loader's workers start (fork) then and inherit the block until ``ignore_stop_signals``. A stop signal
    sent meanwhile to the trainer is delivered when the block ends: the graceful stop is only delayed."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        it = iter(batches)
        first = next(it, _END)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    if first is not _END:
        yield first
        yield from it


_END = object()


def held_out_loader(cfg: Config, dataset: CropDataset, batch_size: int = EVAL_BATCH_SIZE, seed: int = EVAL_SEED,
                    max_batches: int = 0, rank: int = 0, world_size: int = 1) -> DataLoader:
    """Deterministic batches of ``dataset`` (centre crops, ``CropDataset(random_crop=False)``): no noise
    mixup, span masks seeded by ``seed``, batches of ``batch_size`` consecutive crops in dataset order, the
    first ``max_batches`` of them (0: all), of which this process takes every ``world_size``-th from
    ``rank``. So a batch, its masks included, is the same at any process count. Items as ``Collator``'s:
    wav/clean_wav [B, 320 * T], codes [B, K, T], mask [B, T]."""
    starts = list(range(0, len(dataset), batch_size))
    if max_batches:
        starts = starts[:max_batches]
    batches = [list(range(s, min(s + batch_size, len(dataset)))) for s in starts[rank::world_size]]
    # Its own generator: iterating must not draw from the global RNG (the training's dropout and init).
    return DataLoader(dataset, batch_sampler=batches, collate_fn=Collator(cfg.data, cfg.model, seed=seed, mixup=False),
                      generator=torch.Generator().manual_seed(seed))


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
        yield from started(it)
        epoch, skip = epoch + 1, 0
