"""A discrete-event simulator of one Libra GRPO job at cluster scale (pure: stdlib, numpy and the planner).

Modules, each with one job:

- `lengths`: seeded, long-tailed response lengths whose mean drifts over the job, drawn once per step, and
  the drift curve (`DriftCurve`) shared with the `drift` task of `libra.data.drift_task`.
- `decode`: continuous-batching decode of one rollout instance with a KV-cache limit, exact (per request)
  and in aggregate (per batch), and the rollout pool's generation time for one step.
- `allocation`: a split of the cluster (training GPUs and layout, rollout instances) and the splits a
  policy may choose from.
- `costs`: phase times from the planner's cost model (training per layout, weight sync per method and
  strategy, switch costs per reconfiguration strategy), cached.
- `exact`: a per-request reference of a job on a rollout pool (every response, every decode step, the
  runtime's admission and routing rules), against which the engine's per-batch aggregate is tested.
- `fidelity`: one job of one rollout instance or a pool run by the engine and by `exact`, for the tests and
  `benchmarks/sim_fidelity.py`.
- `engine`: the event loop: rollout batches, training steps, weight syncs, reconfigurations, node
  failures and repairs; it records a timeline and the totals.
- `policies`: how the split is chosen: a static split, the planner's initial split, online re-planning per
  strategy (the tail-aware predictor, or `planner.replan`), EHP, and the colocated baseline; the best static
  split by search.
- `predictor`: the elastic policy's step-time predictor: projected lengths (long tail included) and the
  engine replayed through a switch to each candidate split.
- `report`: where a run's time went, interval by interval (split, step time, pool busy shares, switches).
- `calibration`: compare simulated step times and throughput with measured runs.
- `fit`: fit the measured-cost constants (`costs.MeasuredCosts`) to some measured runs and predict the others.

Assumptions and their sources are written where they are used and collected in cluster_manual/simulator.md.
"""
