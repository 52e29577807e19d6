"""pipeline: the driver above the passes and the planner — it runs the pass list over a captured step and asks
the planner where everything lives. The only package that imports both `passes/` and `planning/`."""
