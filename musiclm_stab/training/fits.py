"""Settings that are valid alone but do not fit the data or the machine, refused before any work.

The config's own checks (config/) cannot know the data or the machine. At the start of a run, before
the run directory is touched or the model built, the trainer checks here that

- the model's acoustic heads fit the data's codes: ``model.num_codebooks`` and ``model.codebook_size`` are
  those of the tokenizer (``tokenizer.json``), where they had failed in the first step with an IndexError
  (a code beyond the heads) or a shape error;
- the run can fit in memory: a lower bound of what it needs (``memory_needed``: the parameters, their
  gradients and AdamW's two moments, fp16's master copy, the background checkpoint's host copy, and the
  activations of one micro-batch that the backward pass must keep) against what the machine has
  (``available_memory``). The bound counts only what is certainly allocated, so a run it refuses cannot
  run; a run it passes may still run out of memory (workspace, the allocator's caching, attention
  scores). A model too large for the machine had been built first, then died with an allocation error,
  or was killed by the kernel after minutes of paging.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from musiclm_stab.config.checks import ConfigError
from musiclm_stab.config.sections import Config
from musiclm_stab.constants import FRAME_RATE, HOP_LENGTH

GIB = 2**30


def check_data_fits(cfg: Config, info: dict) -> None:
    """ConfigError unless the model's heads have the codebooks of the data's tokenizer (``info``: its
    tokenizer.json, as ``load_tokenized`` returns it)."""
    m = cfg.model
    for key, what in (("num_codebooks", "codebooks"), ("codebook_size", "codes per codebook")):
        have = info.get(key)
        if have is not None and getattr(m, key) != have:
            raise ConfigError(f"model.{key}={getattr(m, key)} does not fit data.path={cfg.data.path}: its "
                              f"tokenizer (tokenizer.json) gives {have} {what}, and the acoustic heads predict "
                              f"one class per code of each codebook; set model.{key}={have}")


@dataclass
class MemoryNeed:
    """A lower bound of one process's memory (bytes) and its parts."""

    parameters: int  # number of parameters
    state: int  # parameters, gradients, optimizer state (fp16: and the fp32 master copy)
    host_copy: int  # the background checkpoint writer's CPU copy of weights and optimizer state
    activations: int  # kept for the backward pass, one micro-batch

    def on(self, device_type: str, local_processes: int = 1) -> dict[str, int]:
        """Bytes needed on each device and on the host by the ``local_processes`` of one machine
        ({"device": ..., "host": ...}; one pool on CPU). Each process holds its parameter state and
        activations; only the main process keeps the checkpoint's host copy."""
        if device_type == "cpu":
            return {"host": local_processes * (self.state + self.activations) + self.host_copy}
        return {"device": self.state + self.activations, "host": self.host_copy}


def count_parameters_of(cfg: Config) -> int:
    """The model's parameter count, from a build on the meta device (no memory for the weights)."""
    import torch

    from musiclm_stab.model import MusicMLM, count_parameters

    with torch.device("meta"):
        return count_parameters(MusicMLM(cfg.model))


def memory_needed(cfg: Config) -> MemoryNeed:
    """A lower bound of what training ``cfg`` takes per process (module docstring)."""
    m, t = cfg.model, cfg.train
    n = count_parameters_of(cfg)
    # weights + gradients + AdamW's two moments, fp32; fairseq fp16: fp16 weights and gradients, fp32 master
    # weights and their gradients, the moments
    per_param = 20 if (t.mixed_precision == "fp16" and t.fp16_mode == "fairseq") else 16
    host_copy = 0 if t.spike_guard else 12 * n  # weights + moments, kept between checkpoints (checkpoint_writer)
    frames = round(cfg.data.crop_seconds * FRAME_RATE)
    rows = cfg.data.batch_size * frames
    # the first conv's output (conv_dim channels at 1/5 of the samples), each layer's input and its
    # feed-forward's hidden activations (only the inputs with activation checkpointing, and one layer's)
    layers = m.num_layers * m.width + (m.ffn_dim if t.activation_checkpointing else m.num_layers * m.ffn_dim)
    per_row = (m.conv_dim * HOP_LENGTH // 5 if m.feature_grad_mult > 0 else 0) + layers
    value = 2 if t.mixed_precision in ("fp16", "bf16") else 4
    return MemoryNeed(n, per_param * n, host_copy, value * rows * per_row)


def _cgroup_room() -> int | None:
    """Memory this process's cgroup may still take (its limit minus its usage, the tightest level of its
    hierarchy: cgroup v2, or v1's memory controller), None if unlimited or unknown."""
    rooms = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: check every level from the process's own up to the root
            here = Path("/sys/fs/cgroup") / path.lstrip("/")
            for d in (here, *here.parents):
                if not str(d).startswith("/sys/fs/cgroup"):
                    break
                rooms.append(_room(d / "memory.max", d / "memory.current"))
        elif "memory" in controllers.split(","):
            d = Path("/sys/fs/cgroup/memory")
            rooms.append(_room(d / "memory.limit_in_bytes", d / "memory.usage_in_bytes"))
    rooms = [r for r in rooms if r is not None]
    return min(rooms) if rooms else None


def _room(limit_file: Path, usage_file: Path) -> int | None:
    try:
        limit = limit_file.read_text().strip()
        if limit == "max" or int(limit) >= 2**60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, int(limit) - int(usage_file.read_text().strip()))
    except (OSError, ValueError):
        return None


def available_memory(device) -> dict[str, tuple[int, str]]:
    """{"host": (bytes, how measured), "device": (bytes, how measured) on a GPU}: memory available now to
    this process (host: MemAvailable and free swap, within its cgroup's limit; GPU: the device's free
    memory). Only what can be measured is included."""
    out: dict[str, tuple[int, str]] = {}
    try:
        meminfo = {k: int(v.split()[0]) * 1024 for k, v in
                   (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)}
        host, how = meminfo["MemAvailable"] + meminfo.get("SwapFree", 0), "available memory and swap"
        room = _cgroup_room()
        if room is not None and room < host:
            host, how = room, "its cgroup's memory limit"
        out["host"] = (host, how)
    except (OSError, KeyError, ValueError):  # not Linux: no host check
        pass
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        out["device"] = (free, f"free memory of {device}")
    return out


def check_memory_fits(cfg: Config, device, local_processes: int = 1) -> MemoryNeed:
    """ConfigError if the lower bound of ``memory_needed`` for the ``local_processes`` of this machine is
    above what ``available_memory`` finds, in any pool; returns the need."""
    need = memory_needed(cfg)
    needs = need.on(getattr(device, "type", "cpu"), local_processes)
    for pool, (have, how) in available_memory(device).items():
        want = needs.get(pool, 0)
        if want > have:
            m = cfg.model
            per = f" for {local_processes} processes" if pool == "host" and local_processes > 1 else ""
            raise ConfigError(
                f"the model does not fit in memory: model.size={m.size} with num_layers={m.num_layers}, "
                f"width={m.width}, ffn_dim={m.ffn_dim}, conv_dim={m.conv_dim}, pos_conv_kernel={m.pos_conv_kernel} "
                f"has {need.parameters:,} parameters, and training it (data.batch_size={cfg.data.batch_size}, "
                f"data.crop_seconds={cfg.data.crop_seconds:g}) needs at least {want / GIB:,.1f} GiB of "
                f"{'GPU' if pool == 'device' else 'host'} memory{per}, where {have / GIB:,.1f} GiB is available "
                f"({how}); choose a smaller model or batch")
    return need


def local_process_count(num_processes: int) -> int:
    """The processes of this job on this machine (torchrun and accelerate set LOCAL_WORLD_SIZE)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", num_processes)))
    except ValueError:
        return max(1, num_processes)
