"""Reading tokenized data for training and evaluation: crops, the held-out split, batches, streaming.

    crops.py      held-out split by track, frame-aligned crops, the epoch's permutation
    streaming.py  the same crops from a stream, split across processes and loader workers by rule
    collate.py    batches: noise mixup of the input, span masks (masking.py)
    loader.py     the training loader of a run's config, and the endless micro-batch stream (exact resume)
"""

from musiclm_stab.data.collate import Collator, noise_mixup
from musiclm_stab.data.crops import (
           CropDataset,
           EpochSampler,
           crop_item,
           eval_tracks,
           example_key,
           split_indices,
)
from musiclm_stab.data.masking import span_mask

__all__ = ["Collator", "CropDataset", "EpochSampler", "StreamingCrops", "crop_item", "eval_tracks",
           "example_key", "noise_mixup", "span_mask", "split_indices"]


def __getattr__(name: str):
    """StreamingCrops on first use: its module imports datasets (and pandas, pyarrow), 1.2 s of CPU per process
    here that the masks, crops and batches do not need (benchmarks, the model's users)."""
    if name == "StreamingCrops":
        from musiclm_stab.data.streaming import StreamingCrops

        return StreamingCrops
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
