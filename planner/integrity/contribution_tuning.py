"""The replica contribution monitor's tuning: its CUSUMs, robust spreads, attribution and response test."""
from __future__ import annotations

WARMUP_STEPS = 5     # steps that teach the spreads and the history before anything is flagged
# Honest replicas are exchangeable: each one's log norm minus its peers' median, and its density minus its
# peers', have mean zero, whatever the stage's gradients do (a loss spike moves every replica). One step says
# little (gpt-tiny, one microbatch a replica: honest norms differ up to 3x), a persistent offset says much: a
# two-sided CUSUM per replica and test of the offset in robust deviations (Page; allowance CUSUM_K, alarm at
# CUSUM_H: ~300 honest steps between false alarms for normal scores, 3-4 steps to alarm at a 3x scale).
CUSUM_K, CUSUM_H, CUSUM_CAP = 0.5, 5.0, 4.0
# After a flag a norm or density CUSUM restarts here: an offset of 3 deviations alarms again the next step,
# a single honest spike does not (3.5, a 2-deviation restart, flags an honest twin whose norm jumps twice).
CUSUM_RESTART = 2.5
# A replica whose norm or density CUSUM reaches this is a suspect: its verifier audits every one of its
# microbatches (``audit``) until it clears, and an audit that vouches for its contribution withdraws the
# alarm (the clean runs' only false blame: honest twins' norm CUSUMs at 5.0-6.0, climbing for several steps).
SUSPECT_H = CUSUM_H / 2
# Density, l1 / (sqrt(n) l2): a gradient is concentrated (gpt-tiny's middle stage: 0.47-0.55, twins within
# 0.03 of each other a step), Gaussian noise is not (0.80): noise as large as the gradient lifts it to 0.72.
# Agreement, the mean cosine of each replica with the sum of the others: honest twins +0.3-0.5 (+-0.2-0.35 a
# step), a sign flip -0.4: a one-sided CUSUM of its drop below its in-control median alarms in 2-4 steps.
# Floors: honest replicas' log norms differ by 0.3-1.1 a step at one microbatch each (gpt-tiny), but agree
# to 0.01-0.05 in the first steps, which would teach a spread that later honest steps alarm against.
SPREAD_WINDOW = {"norm": 64, "dens": 64, "agree": 64, "resp": 64, "resp_level": 64}
SPREAD_FLOOR = {"norm": 0.25, "dens": 0.03, "agree": 0.15, "resp": 0.25, "resp_level": 0.0}
# offsets a spread needs before its CUSUM runs (the agreement has one a step, the others one a replica)
SPREAD_MIN = {"norm": 16, "dens": 16, "agree": 8, "resp": 16, "resp_level": 1}
STAGE_SERIES = -1    # the key of the stage's median in ``StageHistory.series``
ATTRIBUTION_MARGIN = 2.0   # the replica flagged moved at least this many times as far as the next one
MIN_MOVE = {"norm": 1.0, "dens": 3.0}   # ... and at least this many robust deviations of its test (twins'
# honest density drifts reach 0.04 at a 0.03 spread, noise as large as the gradient moves it by 0.2)
SERIES_STEPS = 64    # each replica's recent values per test, to tell which twin moved when an alarm comes
BEFORE_STEPS = 8     # how many steps before an alarm's onset a replica's level is read from
# A recent step read as an onset though no alarm began there: its move is read over at least this many steps and
# must be RECENT_MOVE times the least move of an alarm's onset, on the side of the mover's own alarmed CUSUM.
RECENT_MIN_STEPS = 3
RECENT_MOVE = 2.0
HISTORY_BETA = 0.9   # the stage's EMAs: of its sent directions (the response test), of its accepted mean (clipping)
# Which of two twins flipped its sign: both agree with each other as little as the other, but after an update
# that took in a flipped contribution, the honest twin's next gradient pushes back against it (curvature: the
# step climbed the attacker's data's loss), the flipped one goes with it. So the flipped twin agrees more with
# the EMA of the stage's sent directions (gpt-tiny: +0.3-0.5 +- 0.5 a step over its twin, honest 0 +- 0.33);
# it is flagged once that lead since the agreement alarm's onset is this many standard errors.
RESPONSE_Z = 2.5
# ... read only where honest twins agreed little with that history before (its in-control median cosine):
# where the stage's gradient keeps its direction from step to step (little feedback from the updates), the
# history still holds the honest past a flip points against, and the honest twin leads instead.
RESPONSE_MAX_LEVEL = 0.5
POST_Z = 1.0   # the lead on the history's part since the onset alone, in standard errors, the same way
# ... unless the lead on the whole history is this many standard errors where honest twins barely agreed with the
# history before (median at most RESPONSE_DECISIVE_LEVEL): no honest past there for a flip to point against, and
# the part since the onset is a step or two of noise (gpt-tiny, 2 replicas, lr 1e-3: lead z 3.5-5 from the third
# step, the post-onset part against it for four steps: banned +14)
RESPONSE_DECISIVE_Z = 4.0
RESPONSE_DECISIVE_LEVEL = 0.25
RESPONSE_MIN_STEPS = 3   # steps since the onset before the response is read (one step is a coin toss)
CONTRIB_REASONS = ("contrib_norm", "contrib_density", "contrib_dir", "contrib_nonfinite")
