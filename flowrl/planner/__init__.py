"""Plans for clusters that are not here (flowrl.planner): for now the fused actor/critic training schedule
(`fuse_schedule`, what `flowrl fuse-schedule` prints). Standard library only."""
