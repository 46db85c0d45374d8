"""The built-in pass pipeline, in order. Each import registers one pass; PIPELINE is their order."""

from flowrl.passes import fuse_gen_inference, fuse_train, on_policy, share_prefix  # noqa: F401  (registers them)

PIPELINE = ("on-policy-logp", "share-prefix", "fuse-gen-inference", "fuse-train")
