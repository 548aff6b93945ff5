"""The Global Resource Planner (GRP) as a pure library (stdlib, numpy, scipy; nothing of libra).

Modules: `model_spec` (architecture from config.json), `hardware` (GPU catalog), `workload` (all other
inputs), `activations` and `memory` (bytes per GPU, named terms), `cost` (seconds per step), `layout`
(parallel degrees and their rules), `search` (enumerate -> estimate -> prune -> select), `plan` and `report`
(results and their JSON form), `explain` (memory messages), `advice` (warnings, options that change the
largest phase, why infeasible and what to change), `grp` (search + advice), `replan` (online re-planning),
`diff` (plan differences). Entry point: `planner.grp.plan(PlannerInputs) -> Plan`.

This package file imports nothing so that `planner.model_spec` and `planner.hardware` stay light.
"""
