"""The learning study's pre-registered parameters (issue 55, docs/STUDY.md "The learning study"): what its
pre-registration fixes, in one place. The analysis (analysis/learning.py), its report, its power simulation
(analysis/power_runs.py) and its plan (experiments/study_plan.py) read them from here.

The calibration and pilot rules in docs/STUDY.md set L, H, DELTA_EARLY (from the calibration runs),
CONTROL_LAYERS and CONTROL_LR (from the pilots). L, H and DELTA_EARLY are the calibration's (its runs, seed 300,
analysis/horizon.py's rule); CONTROL_LAYERS and CONTROL_LR the pilots' (seed 301, analysis/pilot_rule.py's rule).
SPIKE_SMOOTH was fixed after the pilots (docs/STUDY.md, "The plan"). The rest is fixed by the design. A change to
this file after the pre-registration commit is a deviation, to be reported with the results.
"""

from __future__ import annotations

# Fixed by the calibration (docs/STUDY.md, "Calibration: the result"; `python -m musiclm_stab.analysis.horizon`).
L = 0.003  # the claims arm's peak lr
H = 1000  # the claims arm's horizon, steps
DELTA_EARLY = 0.694  # bits: (a) and (d)-slower's margin, 1% of the calibration's early loss (69.41 bits)

# Fixed by the design (docs/STUDY.md).
MARGIN_LEARNED = 0.1  # bits below the unigram level the final held-out cb0 must reach: learned
CONTROL_MARGIN = 0.1  # bits: the positive control's interaction is absent within +-this
DELTA_LN_GRAD = 0.1  # (b): ln median grad norm
DELTA_COUNT = 0.5  # (c), (d)-steadier: events per run
DELTA_STEPS = 10  # the mechanism checks: steps survived
SHARED_STEPS = 3  # a spike within this many steps of another role's in the block is a shared hard batch
SPIKE_SMOOTH = 25  # a spike's level: the running minimum of the trailing 25-step median (fixed after the pilots)
RELAX_ACTS = 0.1  # attention-logit headroom below which relax equals plain attention
CLAIMS_LAYERS = 8  # the claims arm's depth, and the mechanism arm's
MECH_LR = 1e-1  # the mechanism arm's lr: where the instability study's Pre-LN overflowed fp16
MECH_STEPS = 120  # the mechanism arm's horizon, steps
CONTROL_LRS = (L, 3 * L)  # the control's rates by its pre-registered rule (docs/STUDY.md): L, else 3L
# Fixed by the pilots' rule (docs/STUDY.md, "Pilots"): its step 4, the pilots showing no sign of the effect at 8 or
# 24 layers, L or 3L; 8 layers at the rate of the larger 8-layer interaction, L (+0.006 bits against 3L's -0.083).
CONTROL_LAYERS = CLAIMS_LAYERS  # the control's depth
CONTROL_LR = L  # the control's rate, one of CONTROL_LRS

# The design's arms, roles and checks (analysis/learning.py's docstring says what each role's run is).
CLAIMS, MECHANISM = "claims", "mechanism"  # the study's two arms
CONTROL_CELLS = ("pre_w", "pre_nw", "post_w", "post_nw")  # the positive control's 2 x 2: warmup x Pre/Post-LN
MECH_ROLES = ("m_fp16", "m_warmup", "m_fp32", "m_post10", "m_post10_relax")  # the mechanism arm's runs
# the mechanism checks: (key, what survived(treated) - survived(baseline) > 0 says, treated, baseline)
MECH_CHECKS = (("M1", "warmup delays or prevents the Pre-LN failure", "m_warmup", "m_fp16"),
               ("M2", "in fp32 the same run survives longer: the failure is fp16's range, not the optimization",
                "m_fp32", "m_fp16"),
               ("M3", "relax delays or prevents Post-Norm's attention-logit failure", "m_post10_relax", "m_post10"))
