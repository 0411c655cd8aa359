"""Does an fp16 run of each study recipe overflow early at a high learning rate? One short run per recipe.

Each study recipe (recipes/study_*.yaml: fairseq fp16, the plain runs on the explicit attention product,
relax on PB-relax) with the study's GPU overlay (base size, one GPU, no accumulation) trains ``--steps``
updates at peak lr ``--lr`` through recipes/pretrain.py, one after another; the table gives, per recipe,
the overflowed iterations (updates skipped by the loss scaler), the first one, the loss scale at the end,
whether the scale reached its floor (exit status 3: diverged), the largest attention logit logged, and the
last training loss.

    python benchmarks/study_overflow.py --data TOKENS --lr 1.5e-2 --steps 200          # GPU: 10x MERT-330M's lr
    python benchmarks/study_overflow.py --data TOKENS --overlay recipes/overlays/tiny.yaml --device cpu \\
        --steps 3 --set data.batch_size=2 data.crop_seconds=2.0 --recipes study_prenorm_attnrelax_clip1  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from musiclm_stab.experiments.study_plan import STUDY_RECIPES, recipe_path  # noqa: E402

EXIT_DIVERGED = 3  # recipes/pretrain.py: fp16's loss scale reached its floor


def summarize(run_dir: Path, returncode: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [r for r in rows if "event" not in r]
    overflows = [(r["step"], r.get("overflow_step", 0)) for r in metrics if r.get("overflow_step")]
    events = [r for r in rows if r.get("event") == "min_loss_scale"]
    logits = [v for r in metrics for k, v in r.items() if k.startswith("diag/max_attn_logit/")]
    last = metrics[-1] if metrics else {}
    return {"overflowed": sum(n for _, n in overflows) + sum(e.get("overflow_step", 0) for e in events),
            "first_overflow_row": overflows[0][0] if overflows else None,
            "loss_scale_end": events[-1]["loss_scale"] if events else last.get("loss_scale", math.nan),
            "diverged_at": events[-1]["step"] if events else None, "exit": returncode,
            "steps": last.get("step", 0), "max_attn_logit": max(logits) if logits else math.nan,
            "last_loss": last.get("loss", math.nan), "skipped": sum(r.get("skipped_step", 0) for r in metrics)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a tokenized dataset (musiclm-stab tokenize)")
    p.add_argument("--lr", type=float, default=1.5e-2, help="peak lr (default 10x MERT-330M's 1.5e-3)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--overlay", action="append", help="overlays after each recipe (default: the study's GPU one)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE", help="further overrides")
    p.add_argument("--recipes", nargs="+", default=list(STUDY_RECIPES), choices=STUDY_RECIPES,
                   help="which study recipes (default: all four)")
    p.add_argument("--out", help="folder for the runs and their logs (default: a temp dir)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="study_overflow_"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    overlays = args.overlay or [str(REPO / "recipes" / "overlays" / "study_gpu.yaml")]
    every = max(1, args.steps // 20)
    results = {}
    for stem in args.recipes:
        cmd = [sys.executable, str(REPO / "recipes" / "pretrain.py"), "--config", str(recipe_path(stem))]
        for overlay in overlays:
            cmd += ["--config", overlay]
        cmd += [f"--data.path={args.data}", f"--optim.lr={args.lr}", f"--train.max_steps={args.steps}",
                "--optim.warmup_steps=null", f"--train.output_dir={out}", f"--train.name={stem}",
                f"--train.log_every={every}", f"--train.diagnostics_every={every}", "--train.eval_every=0",
                f"--train.checkpoint_every={args.steps}", "--train.trackers=[]",
                *(f"--{s}" for s in args.set)]
        with (out / f"{stem}.log").open("w") as log:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode not in (0, EXIT_DIVERGED):
            sys.exit(f"{stem} failed (exit {proc.returncode}); its output: {out / f'{stem}.log'}")
        results[stem] = summarize(out / stem, proc.returncode)
    print(f"fp16 (fairseq mode), peak lr {args.lr:g} (warmup {0.08:.0%} of the run), {args.steps} steps, "
          f"overlays {', '.join(Path(o).name for o in overlays)}")
    print("| recipe | overflowed iterations | first overflow (row step) | loss scale at the end | diverged at | "
          "max attention logit | last loss | skipped |")
    print("|---|---|---|---|---|---|---|---|")
    for stem, r in results.items():
        print(f"| {stem} | {r['overflowed']} | {r['first_overflow_row'] or '-'} | {r['loss_scale_end']:g} | "
              f"{r['diverged_at'] or '-'} | {r['max_attn_logit']:.3g} | {r['last_loss']:.4g} | {r['skipped']} |")
    (out / "study_overflow.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
