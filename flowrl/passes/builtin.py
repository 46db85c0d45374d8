"""The built-in pass pipeline, in order. Each import registers one pass; PIPELINE is their order."""

from flowrl.passes import (  # noqa: F401  (registers them)
    async_rollout,
    drop_reference,
    fuse_gen_inference,
    fuse_train,
    on_policy_logp,
    score_tail,
    share_prefix,
)

PIPELINE = ("on-policy-logp", "drop-reference", "async-rollout", "share-prefix", "fuse-gen-inference", "score-tail", "fuse-train")
