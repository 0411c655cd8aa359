"""The optimizer and the learning-rate schedule: AdamW, linear warmup then linear decay to 0."""

from __future__ import annotations

import torch

from musiclm_stab.config.sections import OptimConfig


def frontend_groups(model: torch.nn.Module, params: list, cfg: OptimConfig) -> list:
    """``params`` (the trained parameters of ``model`` in its ``parameters()`` order, or their fp32 master
    copies in that order) as optimizer parameter groups: one group, or with ``optim.frontend_lr`` set two,
    the conv frontend's (``model.frontend``) at its own peak lr, the rest at ``optim.lr``."""
    if cfg.frontend_lr is None:
        return params
    trained = [p for p in model.parameters() if p.requires_grad]
    if len(trained) != len(params):
        raise ValueError(f"{len(params)} parameters to optimize for the model's {len(trained)} trained ones")
    frontend = {id(p) for p in model.frontend.parameters()}
    in_frontend = [id(p) in frontend for p in trained]
    return [{"params": [q for q, f in zip(params, in_frontend) if not f]},
            {"params": [q for q, f in zip(params, in_frontend) if f], "lr": cfg.frontend_lr}]


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with the configured betas, eps and weight decay (``optim.fused``: torch's fused kernel). Loading
    a checkpoint into it keeps the configured kernel (``keep_configured_kernel``). ``params``: parameters
    or groups (``frontend_groups``); a group without its own lr takes ``optim.lr``."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                  fused=cfg.fused or None)
    optimizer.register_load_state_dict_pre_hook(keep_configured_kernel)
    return optimizer


def lr_lambda(warmup_steps: int, max_steps: int):
    """Linear warmup to the peak lr over ``warmup_steps``, then linear decay to 0 at ``max_steps``."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))

    return f


# A checkpoint's data position (micro-batches consumed) means the same batches only with these unchanged.


def keep_configured_kernel(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Optimizer ``load_state_dict`` pre-hook: keep the kernel the optimizer was built with.

    torch restores a checkpoint's ``param_groups`` whole, kernel choice (``fused``, ``foreach``) included,
    so a run resumed with another ``optim.fused`` would silently keep the old kernel. The kernel does not
    change the math, so the configured one wins; each ``step`` counter moves to where that kernel keeps it
    (fused or capturable: on the parameter's device, which torch's load does; else on the CPU, as a fresh
    optimizer has it, instead of one host sync per parameter and step)."""
    for saved, now in zip(state_dict["param_groups"], optimizer.param_groups):
        for key in ("fused", "foreach"):
            if key in now:
                saved[key] = now[key]
        if now.get("fused") or now.get("capturable"):
            continue
        for pid in saved["params"]:
            step = state_dict["state"].get(pid, {}).get("step")
            if isinstance(step, torch.Tensor):
                state_dict["state"][pid]["step"] = step.cpu()
    return state_dict
