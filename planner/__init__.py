"""The Global Resource Planner (GRP) as a pure library (stdlib, numpy, scipy; nothing of libra).

Modules: `model_spec` (architecture from config.json), `hardware` (GPU catalog), `workload` (all other
inputs), `activations` and `memory` (bytes per GPU, named terms), `cost` (seconds per step), `layout`
(parallel degrees and their rules), `search` (enumerate -> estimate -> prune -> select), `plan` and `report`
(results and their JSON form), `advice` (why infeasible, what to change), `replan` (online re-planning),
`diff` (plan differences). Entry point: `planner.search.search(PlannerInputs) -> Plan`.

This package file imports nothing so that `planner.model_spec` and `planner.hardware` stay light.
"""
