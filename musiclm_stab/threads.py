"""torch's CPU thread count, set for a block of work (the tokenizer's encoders and k-means, the probes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one CPU thread inside the block (also usable as a decorator), the count restored after.

    Two reasons. Float results depend on the thread count (reductions split differently), so the
    tokenizer's codes at near-ties and its k-means use one thread everywhere, resumed or not. And on
    cores that other processes share, small operations (scatter adds, LSTM steps, the probes' fits)
    spend their time at barriers waiting for a descheduled thread: measured on the 2-core machine under
    load, key probes ran 20x slower with 2 threads than with 1.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
