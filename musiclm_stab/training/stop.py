"""Graceful stop: SIGTERM / SIGINT ask the training loop to checkpoint and stop after the current step."""

from __future__ import annotations

import signal
import threading

import torch
from accelerate import Accelerator


class StopSignal:
    """SIGTERM / SIGINT (what schedulers send before preemption) ask the loop to checkpoint and stop
    after the current step. Under several processes the request is agreed on by all ranks."""

    def __init__(self):
        self.name: str | None = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.name = signal.Signals(signum).name

    def requested(self, accelerator: Accelerator) -> bool:
        if accelerator.num_processes == 1:
            return self.name is not None
        flag = torch.tensor([1.0 if self.name else 0.0], device=accelerator.device)
        if accelerator.reduce(flag, reduction="sum").item() > 0:
            self.name = self.name or "a signal on another process"
            return True
        return False

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
