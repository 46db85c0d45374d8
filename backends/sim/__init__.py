"""The simulator (flowrl.backends.sim): a compiled flow's steps on a described cluster, under the scheduling
policies of the seed papers, with the serverless backend's own policy functions (flowrl.elastic).

hardware (cluster specs) -> shapes (model sizes) -> work (what a flow's step computes) + workload (lengths) ->
costs (seconds per operation, calibrated by `calibrate`) -> generation (the decode DES) -> policies -> simulate
(`flowrl simulate`) and plan (`flowrl plan`); commands holds the command-line verbs.
"""
