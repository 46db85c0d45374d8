"""The elastic-pool policy (RLHFless, arXiv 2602.22718): what to run where, decided by pure functions.

The serverless backend calls these on real workers and the simulator calls them on a simulated cluster, so one
policy is measured in both places. Nothing here touches a device, a process or a clock:
- `predict`: per-prompt response-length prediction (EWMA by prompt id) and how well it ranked the real lengths;
- `assign`: length-ranked assignment of a step's prompts to generation instances (contiguous runs);
- `scale`: the generation time and device-seconds of N instances from predicted lengths and a measured
  time-per-decode-step curve, and the cost-weighted choice of N;
- `migrate`: when an instance's unfinished sequences move (cut-and-migrate) and to which instance;
- `prewarm`: when to start a stage's instances so that they are ready before it starts;
- `prefill`: which instance computes a prompt prefix shared across instances, and whether the others take its
  keys and values or compute it themselves (deduplicated prefill).
Imports only the standard library.
"""

from flowrl.elastic.assign import ranked_runs
from flowrl.elastic.migrate import migration_target, should_migrate
from flowrl.elastic.predict import LengthPredictor, spearman
from flowrl.elastic.prefill import PrefixShare, hand_over, share_prefixes
from flowrl.elastic.prewarm import prewarm_delay
from flowrl.elastic.scale import Candidate, DecodeCurve, ScaleChoice, choose_instances, estimate

__all__ = ["Candidate", "DecodeCurve", "LengthPredictor", "PrefixShare", "ScaleChoice", "choose_instances", "estimate",
           "hand_over", "migration_target", "prewarm_delay", "ranked_runs", "share_prefixes", "should_migrate",
           "spearman"]
