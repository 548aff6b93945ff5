"""A controller process for the reconfiguration integration tests: runs the job of a config file as
`libra launch` does (same Controller, same run directory) and, once the job has trained `--at-step` steps,
asks for one reconfiguration through the public `Controller.request_reconfigure`.

With `--then-instances N` it asks for N instances by diff right after the first request is accepted (while the
first runs) and says whether that was refused ({"second_refused": <error>}) or accepted.

Prints one JSON line per milestone on stdout ({"requested": ...}, {"done": ...}, {"result": ...}), so a
test can follow it, kill it mid-switch (SIGKILL) or stop it (SIGINT, as a terminal does). Exit status as
`libra launch`: 0 finished, 130 interrupted, 1 failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time

from libra.config.loader import load
from libra.controller import Controller, LaunchOptions
from libra.controller.reconfigure import ReconfigureTarget
from libra.run_dir import RunDir


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def request_when_ready(controller: Controller, args: argparse.Namespace) -> None:
    while controller.step < args.at_step:
        if controller.stop.requested:
            return
        time.sleep(0.2)
    target = ReconfigureTarget(args.instances, args.tp)
    try:
        desired = controller.request_reconfigure(target, args.strategy)
    except ValueError as exc:
        say(refused=str(exc), step=controller.step)
        return
    say(requested=desired.reconfiguring, step=controller.step, generation=desired.generation)
    if args.then_instances is not None:
        # a second request while the first runs: the controller must refuse it and say why
        try:
            second = controller.request_reconfigure(ReconfigureTarget(args.then_instances, None), "diff")
        except ValueError as exc:
            say(second_refused=str(exc), step=controller.step)
        else:
            say(second_accepted=second.reconfiguring, step=controller.step)
    while controller.store is not None and controller.store.get().reconfiguring:
        if controller.stop.requested:
            return
        time.sleep(0.2)
    say(done=desired.reconfiguring, step=controller.step)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=0)
    parser.add_argument("--at-step", type=int, required=True)
    parser.add_argument("--instances", type=int, default=None)
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--then-instances", type=int, default=None,
                        help="right after the request is accepted, ask for this many instances by diff")
    args = parser.parse_args()

    cfg = load(args.config, [f"run_dir={args.run_dir}"])
    # The loader still refuses runtime_dynamic_reconfiguration_enabled: true in a job file (it is listed in
    # UNWIRED, libra/config/checks_runtime.py), so the harness turns the switch on after loading.
    gpr = dataclasses.replace(cfg.global_resource_planner, runtime_dynamic_reconfiguration_enabled=True)
    cfg = dataclasses.replace(cfg, global_resource_planner=gpr)
    controller = Controller(cfg, RunDir.at(cfg.run_dir), LaunchOptions(max_steps=args.max_steps, console="plain"))
    threading.Thread(target=request_when_ready, args=(controller, args), name="reconfigure", daemon=True).start()
    result = controller.run_job()
    say(result=result.outcome, step=result.step)
    return {"finished": 0, "interrupted": 130}.get(result.outcome, 1)


if __name__ == "__main__":
    sys.exit(main())
