"""The model card of an export: the README.md that the transformers convention puts beside the weights.

Written from the run's own record, never from memory: its ``config.yaml`` (model, data, optimizer,
precision), its ``tokenizer.json`` (the data and the EnCodec weights its codes came from), the exported
checkpoint's step, the held-out codebook-0 loss of that step when the run was evaluated (``eval/step_N.json``
from ``musiclm-stab evaluate``, the held-out split of the run's own data only, else the ``eval/`` columns of metrics.jsonl from ``train.eval_every``), and
the export's own verification. What the record does not hold, the card says it does not know.

The card travels with the weights to other machines and to the Hub, so it names files and folders by their
last component (a run ``tiny``, data ``default_corpus_tokens``), never by this machine's absolute paths, and
carries no error text: the EnCodec weights are described from their recorded identity and provenance, not
from the free-text note, which may hold why a download failed. Its front matter is the Hub's model card
metadata: ``library_name``, ``license`` (the export's ``license``; ``other`` unless given: the weights'
licence is that of their training data, which the run does not record), ``pipeline_tag``
(``feature-extraction``: hidden states of audio) and tags.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from musiclm_stab.config.sections import Config
from musiclm_stab.constants import CODEBOOK_SIZE, FRAME_RATE, HOP_LENGTH, SAMPLE_RATE, __version__
from musiclm_stab.export.exported import PAD_SAMPLES
from musiclm_stab.training.run_dir import eval_record, same_data

CB0 = "eval/acoustic_mlm_loss/cb0"
PIPELINE_TAG = "feature-extraction"  # the Hub's task for a model whose output is features (hidden states)
UNKNOWN_LICENSE = "other"  # the Hub's value for a licence not in its list: here, whatever the data's is


def _name(path: Any) -> str:
    """A recorded path as the card shows it: its last component (a folder's or file's name), never the
    machine's absolute path."""
    text = str(path)
    return Path(text).name or text


def _cell(text: Any) -> str:
    """Recorded text made safe inside a markdown table cell: no column break, no HTML tag."""
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def held_out_cb0(run_dir: Path, step: int | None, unit: str, data: str | list[str]) -> str:
    """The held-out codebook-0 loss of ``step`` as the run recorded it, in words; or how to get it. Only a
    record of the held-out split of the run's own ``data`` counts (an earlier version wrote other splits and
    data to the same file: such a record is passed over)."""
    if step is not None:
        evaluated = eval_record(run_dir, step, "eval", data, data)
        if evaluated.is_file():
            e = json.loads(evaluated.read_text())
            if CB0 in e and e.get("split") == "eval" and same_data(e.get("data"), data):
                return (f"**{e[CB0]:.3f} {e.get('unit', unit)}** at step {step}, on the {e.get('split', 'eval')} split "
                        f"of `{_name(e.get('data'))}` ({e.get('num_segments')} segments, {e.get('masked_frames')} masked frames; "
                        f"`musiclm-stab evaluate`, {evaluated.relative_to(run_dir)})")
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file():
            for line in metrics.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line (a killed run): the other rows are whole
                if row.get("step") == step and isinstance(row.get(CB0), (int, float)) and math.isfinite(row[CB0]):
                    return (f"**{row[CB0]:.3f} {unit}** at step {step}, evaluated during training on the held-out "
                            "batches (`train.eval_every`, metrics.jsonl)")
    return ("not recorded for this step: run `musiclm-stab evaluate RUN` before exporting to have it here "
            "(the export does not evaluate)")


def _data(cfg: Config, tokenizer: dict[str, Any] | None) -> list[str]:
    paths = cfg.data.path if isinstance(cfg.data.path, list) else [cfg.data.path]
    rows = [f"| data | {', '.join(f'`{_cell(_name(p))}`' for p in paths)} (held-out fraction {cfg.data.eval_fraction:g}, "
            "by track) |"]
    if not tokenizer:
        return [*rows, "| tokenizer | not recorded in the run directory |"]
    hours = tokenizer.get("total_seconds")
    size = (f"{tokenizer.get('num_tracks')} tracks, {hours / 3600:.2f} h of audio" if isinstance(hours, (int, float))
            else "size not recorded")
    rows.append(f"| source | `{_cell(_name(tokenizer.get('source')))}` ({tokenizer.get('source_kind', 'source')}; {size}) |")
    rows.append(f"| targets | EnCodec codes (`{tokenizer.get('model')}`), {tokenizer.get('num_codebooks')} codebooks of "
                f"{tokenizer.get('codebook_size', CODEBOOK_SIZE)} at {tokenizer.get('frame_rate', FRAME_RATE)} Hz; "
                f"{_cell(_weights(tokenizer))} (sha256 `{str(tokenizer.get('weights_sha256'))[:16]}…`) |")
    return rows


def _weights(tokenizer: dict[str, Any]) -> str:
    """The EnCodec weights the codes came from, from their recorded identity (not the free-text note)."""
    if tokenizer.get("weights") == "pretrained":
        return "the pretrained EnCodec 24 kHz weights"
    file = tokenizer.get("weights_file")
    prov = tokenizer.get("weights_provenance")
    named = f"local weights `{_name(file)}`" if file else "local weights"
    if isinstance(prov, dict):
        return (f"{named} made by `{prov.get('made_by')}` (seed {prov.get('seed')}): a random encoder with fitted "
                "codebooks, not the pretrained EnCodec model")
    return named


def model_card(cfg: Config, run_dir: Path, step: int | None, tokenizer: dict[str, Any] | None,
               verification: dict[str, Any], num_parameters: int, license: str | None = None) -> str:
    """The README.md of an export of ``run_dir`` at ``step`` (``cfg``: the run's resolved config); ``license``:
    the Hub's identifier for the weights' licence (``other`` when None)."""
    m, d, o, t = cfg.model.resolved(), cfg.data, cfg.optim, cfg.train
    precision = {"no": "fp32", "bf16": "bf16 autocast"}.get(t.mixed_precision, f"fp16 ({t.fp16_mode}'s arithmetic)")
    accum = f"{t.grad_accum} micro-batch{'es' if t.grad_accum > 1 else ''}"
    worst = max(verification["max_abs_error"].values())
    lines = [
        "---",
        "library_name: transformers",
        f"license: {license or UNKNOWN_LICENSE}",
        f"pipeline_tag: {PIPELINE_TAG}",
        "tags: [audio, music, feature-extraction, hubert, mert, musiclm_stab]",
        "---",
        "",
        f"# {t.name}: a MERT-style music encoder, as a `transformers.HubertModel`",
        "",
        f"The encoder of a music masked-language model pretrained with musiclm_stab {__version__}: a convolutional "
        f"frontend on {SAMPLE_RATE // 1000} kHz mono audio ({FRAME_RATE} frames per second) and a {m.num_layers}-layer "
        f"transformer ({m.width} wide, {m.num_heads} heads, norm scheme `{m.norm_scheme}`; "
        f"{num_parameters / 1e6:.2f}M parameters), trained to predict the EnCodec codes and the constant-Q "
        "spectrum of masked frames (MERT's objective). Exported as a plain `HubertModel` (no remote code) and "
        f"verified layer by layer against the original: largest |difference| {worst:.1e} over every hidden "
        f"state on {_cell(verification['audio'])}.",
        "",
        "## How to load it",
        "",
        "```python",
        "from transformers import HubertModel",
        "from musiclm_stab.export import pad_for_export  # or pad 40 zero samples on each side yourself",
        "",
        'model = HubertModel.from_pretrained("path/to/this/folder")',
        "out = model(pad_for_export(wav), output_hidden_states=True)  # wav: [batch, samples], mono, 24 kHz, float",
        f"out.hidden_states  # {m.num_layers + 1} x [batch, frames, {m.width}] at {FRAME_RATE} Hz: embeddings, then each layer",
        "```",
        "",
        f"Feed it the audio padded with {PAD_SAMPLES} zero samples on each side (`pad_for_export`): then "
        f"{HOP_LENGTH}·T samples give exactly T frames, the frames it was trained on. Unpadded audio gives one frame "
        "fewer, each 40 samples later. `musiclm-stab features path/to/this/folder audio/ out/` writes features of audio "
        "of any length. The acoustic and musical heads are in `heads.safetensors` (`musiclm_stab.export.load_heads`).",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| run | `{_cell(t.name)}` (run directory `{_cell(_name(run_dir))}`) |",
        f"| steps | {step if step is not None else 'unknown'} of {t.max_steps} (optimizer updates) |",
        *_data(cfg, tokenizer),
        f"| batches | {d.batch_size} crops of {d.crop_seconds:g} s per process and micro-batch, {accum} per update |",
        f"| optimizer | AdamW, peak lr {o.lr:g}, {o.warmup_steps} warmup steps then linear decay, gradient clip "
        f"{o.clip_grad:g} |",
        f"| precision | {precision} |",
        f"| model | size `{m.size}`, attention `{m.attention}`, masking p={m.mask_prob:g} spans of {m.mask_length} |",
        "",
        "The whole configuration is in `musiclm_stab.json` (`model_config`) and in the run's `config.yaml`.",
        "",
        "## Held-out loss",
        "",
        f"Codebook-0 cross-entropy of the masked frames: {held_out_cb0(run_dir, step, t.loss_unit, d.path)}. "
        f"Chance is log2({CODEBOOK_SIZE}) = 10 bits.",
        "",
        "## Limits",
        "",
        "What this model learned is what its data holds: the card names the data but cannot judge it. The "
        "weights' licence is that of their training data, which the run does not record"
        + (f"; the exporter named it `{license}`." if license else
           ": the front matter says `license: other` until the exporter names it (`musiclm-stab export --license`)."),
        "",
    ]
    return "\n".join(lines)

