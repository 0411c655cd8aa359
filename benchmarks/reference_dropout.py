"""The "before" variant of the CPU speed work, for benchmarks: torch's own dropout (``bernoulli_``) and SDPA
with dropout, patched into the model's modules for the duration of a ``with torch_dropout():`` block."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch.nn.functional as F

from musiclm_stab.model import attention, encoder, mert


def _torch_dropout(x, p, training):
    return F.dropout(x, p, training=training) if p > 0 else x


def _sdpa_attend(q, k, v, form, *, alpha=32.0, dropout=0.0, training=False):
    if form != "sdpa":
        return _fast_attend(q, k, v, form, alpha=alpha, dropout=dropout, training=training)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if training else 0.0)


_fast_attend = attention.attend


@contextlib.contextmanager
def torch_dropout():
    """Within: torch's dropout and SDPA dropout on CPU too, as before ``fast_dropout`` (benchmarks only)."""
    with contextlib.ExitStack() as stack:
        for module in (attention, encoder, mert):
            stack.enter_context(mock.patch.object(module, "fast_dropout", _torch_dropout))
        stack.enter_context(mock.patch.object(attention, "attend", _sdpa_attend))
        yield
