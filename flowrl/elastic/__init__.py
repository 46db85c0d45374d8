"""The elastic-pool policy (RLHFless, arXiv 2602.22718): what to run where, decided by pure functions.

The serverless backend calls these on real workers and the simulator calls them on a simulated cluster, so one
policy is measured in both places. Nothing here touches a device, a process or a clock:
- `predict`: per-prompt response-length prediction (EWMA by prompt id) and how well it ranked the real lengths;
- `assign`: length-ranked assignment of a step's prompts to generation instances (contiguous runs);
- `scale`: the generation time and device-seconds of N instances from predicted lengths and a measured
  time-per-decode-step curve, and the cost-weighted choice of N;
- `migrate`: when an instance's unfinished sequences move (cut-and-migrate) and to which instance;
- `prewarm`: when to start a stage's instances so that they are ready before it starts;
- `late`: how long after the first chunk a fused stage's forward instances start (a share of their learned
  slack, what they waited for chunks with their slots held);
- `prefill`: which instance computes a prompt prefix shared across instances, and whether the others take its
  keys and values or compute it themselves (deduplicated prefill);
- `env_wait`: the environment wait a multi-turn instance has ahead (from step-latency history) and whether it gives
  its device back while every live trajectory waits on its environment;
- `plan`: one generation's decisions put together (instance count, runs, migration sink) and what a finished
  generation teaches the next (the decode curve), as the backend and the simulator both take them.
Imports only the standard library.
"""

from flowrl.elastic.assign import ranked_runs, split_runs
from flowrl.elastic.env_wait import EnvWaitPredictor, should_release
from flowrl.elastic.late import LATE_SHARE, SLACK_MEAN, late_start, update_slack
from flowrl.elastic.migrate import migration_target, should_migrate
from flowrl.elastic.plan import (
    GenerationPlan,
    learn_decode,
    migration_sink,
    plan_generation,
    predictions,
    start_overhead,
)
from flowrl.elastic.predict import LengthPredictor, spearman
from flowrl.elastic.prefill import (
           HandOver,
           PrefillRates,
           PrefixShare,
           decide_hand_over,
           hand_over,
           share_prefixes,
)
from flowrl.elastic.prewarm import learn_start, prewarm_delay, prewarm_plan
from flowrl.elastic.scale import Candidate, DecodeCurve, ScaleChoice, choose_instances, decode_steps, estimate

__all__ = ["LATE_SHARE", "SLACK_MEAN", "Candidate", "DecodeCurve", "EnvWaitPredictor", "GenerationPlan", "HandOver", "LengthPredictor", "PrefillRates", "PrefixShare",
           "ScaleChoice", "choose_instances", "decide_hand_over", "decode_steps", "estimate", "hand_over", "late_start", "learn_decode",
           "learn_start", "migration_sink", "migration_target", "plan_generation", "predictions", "prewarm_delay",
           "prewarm_plan", "ranked_runs", "share_prefixes", "should_migrate", "should_release", "spearman", "split_runs",
           "start_overhead", "update_slack"]
