"""`fuse-gen-inference` at run time (flowrl.runtime): streamed generation with the forwards over its rollout.

`GenInfer` (scheduler.py) decides who runs what, when; `Feeder` (feeder.py) feeds the forwards placed on other
worker groups; `Results` (results.py) collects chunks and outputs and puts them back in sample order; the job,
event and feed records are in records.py. What a chunk is and how chunks merge lives in `flowrl.runtime.chunks`.
"""

from flowrl.runtime.gen_infer.records import ELSEWHERE, Timed
from flowrl.runtime.gen_infer.scheduler import GenInfer

__all__ = ["ELSEWHERE", "GenInfer", "Timed"]
