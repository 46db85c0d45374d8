"""The environments and tools of the multi-turn examples (examples/calc_tool.flow, examples/guess_number.flow) and
of bench/multiturn.py: plain Python modules the flows name as `"envs.MODULE.NAME"` (the flow's folder is on
`sys.path` wherever an environment runs)."""
