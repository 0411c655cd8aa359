"""Pretraining under accelerate.

    trainer.py     the loop: Trainer.train_step (micro-batches) and Trainer.update; main() for musiclm-stab train
    optim.py       AdamW and the warmup / linear-decay schedule
    stability.py   gradient clipping rules, the spike guard, per-layer diagnostics
    checkpoint.py  checkpoints that are complete or absent, coordinated across processes
    checkpoint_writer.py  the same, written by a thread after a CPU copy of the state
    checkpoint_load.py    loading a checkpoint without unpickling code
    registered.py  the trainer's own stateful objects in a checkpoint, as JSON
    resume.py      refusing a --resume that could not continue exactly
    stop.py        SIGTERM / SIGINT: checkpoint and stop after the current step
    tracking.py    train.trackers, config as hparams, metrics-row counters and cross-process means
    run_dir.py     the run directory: refusals, config.yaml, metrics.jsonl rows
    trained.py     a trained model from a run or checkpoint directory
    held_out.py    the held-out evaluation loop (train.eval_every and musiclm-stab evaluate)
"""
