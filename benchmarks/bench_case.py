"""bench_gpu.py's cases and the study's config for one (``Case``, ``study_config`` and the tables behind them),
without torch: the scripts that only launch others (bench_gpu_loop.py, bench_gpu_runner.py's parent) read
them here, not by importing bench_gpu.py and torch with it (seconds of CPU per process)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from musiclm_stab.config import Config, load_config

REPO = Path(__file__).resolve().parent.parent
MODES = {"fairseq": ("fp16", "fairseq"), "amp": ("fp16", "amp"), "bf16": ("bf16", "fairseq"), "fp32": ("no", "fairseq")}
MODE_DTYPE = {"fairseq": "fp16", "amp": "fp16", "bf16": "bf16", "fp32": "fp32"}
ATTENTIONS = ("math", "relax", "sdpa")
LEVERS = ("gemm", "cudnnbench")
RECIPES = {"relax": "recipes/study_prenorm_attnrelax_clip1.yaml"}  # the plain runs' recipe for math and sdpa
PLAIN_RECIPE = "recipes/study_prenorm_clip1_run2.yaml"
OVERLAYS = {"tiny": ["recipes/overlays/tiny.yaml"], "base": ["recipes/overlays/study_gpu.yaml"], "large": []}
DEFAULT_BATCH = {"tiny": 2, "base": 64, "large": 32}


@dataclass(frozen=True)
class Case:
    mode: str
    attention: str
    levers: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Case:
        head, *levers = text.split("+")
        mode, _, attention = head.partition("-")
        if mode not in MODES or attention not in ATTENTIONS or any(lv not in LEVERS for lv in levers):
            raise argparse.ArgumentTypeError(
                f"case {text!r}: MODE-ATTENTION[+LEVER], MODE one of {', '.join(MODES)}, ATTENTION one of "
                f"{', '.join(ATTENTIONS)}, LEVER one of {', '.join(LEVERS)}")
        return cls(mode, attention, tuple(levers))

    def __str__(self) -> str:
        return "+".join([f"{self.mode}-{self.attention}", *self.levers])


def study_config(size: str, case: Case, overrides: list[str] = ()) -> Config:
    """The study run's resolved config at ``size`` (a study recipe and the scale's overlay) in ``case``'s
    precision and attention form: the model and optimizer the study trains."""
    mp, fp16_mode = MODES[case.mode]
    files = [REPO / RECIPES.get(case.attention, PLAIN_RECIPE)] + [REPO / o for o in OVERLAYS[size]]
    return load_config(files, [f"model.size={size}", f"model.attention={case.attention}",
                               f"train.mixed_precision={mp}", f"train.fp16_mode={fp16_mode}", *overrides])
