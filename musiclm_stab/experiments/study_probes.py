"""The study's linear pitch probes: which runs it probes (the first seed of each configuration at the figure lr
and of the best cell), probing them, and reading a probe a run already holds (docs/STUDY.md; ``musiclm-stab study
--probe``)."""

from __future__ import annotations

import json
from pathlib import Path

from musiclm_stab.experiments.study_plan import STUDY_RECIPES, Study, figure_runs

PROBE = {"tasks": ("pitch",), "baselines": ("random_init",), "l2_grid": (1e-2,)}


def probe_targets(study: Study, stats: list, every_first_seed: bool = False) -> list[Path]:
    """The runs the study probes: the first seed of each configuration at the figure lr, and of the
    (configuration, lr) that the "learns" check reads (analysis/lr_grid.best_cell over the complete blocks
    of ``stats``, the trained runs' RunStats), if another.

    ``every_first_seed``: also the first seed of every other (configuration, lr), after those. A study
    trained in pieces on machines that do not keep checkpoints passes it, so that whichever cell turns
    out best at the end already carries its probe; the claims still read only the runs above."""
    from musiclm_stab.analysis.claims import NoCompleteBlock, study_blocks, used_runs
    from musiclm_stab.analysis.lr_grid import best_cell

    first = study.seeds[0]
    dirs = [run.config().run_dir for run in figure_runs(study) if run.seed == first]
    try:
        best = best_cell(used_runs(study_blocks(stats)))
    except NoCompleteBlock:  # no "learns" check, no best cell (two runs of one block's role still raise)
        best = None
    if best is not None:
        dirs += [d for d in (Path(r.path) for r in best[3] if r.seed == first) if d not in dirs]
    return _with_every_first_seed(study, dirs) if every_first_seed else dirs


def _with_every_first_seed(study: Study, dirs: list[Path]) -> list[Path]:
    """``dirs``, then the first seed of every other (configuration, lr) of the four configurations."""
    rest = [run.config().run_dir for run in study.runs
            if run.stem in STUDY_RECIPES and run.seed == study.seeds[0]]
    return dirs + [d for d in rest if d not in dirs]


def probe_study(study: Study, progress: bool = True, jobs: int = 1, every_first_seed: bool = False) -> Path:
    """Linear pitch probes of the final checkpoints of ``probe_targets`` (with ``every_first_seed``) of
    the study's trained runs, each against its own random init, and their figure (``probe.png`` in the
    study's figures folder, of the runs the claims read); returns the figure.

    One task, one baseline and one L2 penalty (0.01; ``musiclm-stab probe`` chooses among four by inner
    cross-validation, four times the fits) bound its cost (timed in ``timing.json``). Each probed run gets
    RUN/probe/probe.json, which the claims table reads ("learns", the probe column). ``jobs`` runs are
    probed at a time. A run that already holds this probe of its last step (``probed_already``) is read, not
    probed again: a study carried from another machine keeps its probes without its checkpoints.
    """
    from musiclm_stab.analysis.claim_stats import run_stats
    from musiclm_stab.analysis.probe import probe_runs
    from musiclm_stab.analysis.probe_figure import save_probe_figure
    from musiclm_stab.analysis.runs import read_run

    stats = [run_stats(read_run(run.config().run_dir, "bits")) for run in study.runs]
    claimed = probe_targets(study, stats)
    dirs = _with_every_first_seed(study, claimed) if every_first_seed else claimed
    print(f"\n=== linear probes (pitch, against random init) of the first seed of each configuration at the "
          f"figure lr and of the best one{', and of every other cell' if every_first_seed else ''}: "
          f"{len(dirs)} runs", flush=True)
    done = {d: probed_already(d) for d in dirs}
    for d, result in done.items():
        if result is not None:
            print(f"probed already at step {result['step']}: {d / 'probe' / 'probe.json'} (not probed again)")
    todo = [d for d in dirs if done[d] is None]
    fresh = dict(zip(todo, probe_runs(todo, jobs=jobs, progress=progress, **PROBE))) if todo else {}
    return save_probe_figure([done[d] or fresh[d] for d in claimed], study.figures_dir / "probe.png")


def probed_already(run_dir: Path) -> dict | None:
    """RUN/probe/probe.json when it holds the study's probe (``PROBE``'s task, baseline and L2 grid) of the
    run's last logged step, else None."""
    from musiclm_stab.analysis.probe import RESULTS_FILE
    from musiclm_stab.analysis.runs import read_run

    path = run_dir / "probe" / RESULTS_FILE
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    same = (result.get("tasks") == list(PROBE["tasks"]) and result.get("l2_grid") == list(PROBE["l2_grid"])
            and list(result.get("results", {})) == ["model", *PROBE["baselines"]])
    return result if same and result.get("step") == read_run(run_dir).last_step else None
