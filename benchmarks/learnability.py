"""Learnability study: how many GRPO steps a tiny random model needs to learn a built-in task.

A single-process, pure-torch mirror of what the real pipeline does each step: take `batch_size` prompts from
the task (libra.data, the same code the controller uses), sample `n_samples` responses of at most
`max_new_tokens` tokens per prompt at temperature 1 (optionally from a policy `policy_lag` steps old, like
asynchronous rollouts), score them with the task's reward, compute advantages with libra.algo.advantages,
then take `updates_per_batch` Adam steps (constant learning rate, no gradient clipping, as Megatron-Core on
a CPU) on the GRPO loss of libra.algo.grpo: PPO-clip, entropy bonus and optional KL to the initial model.

For every candidate setting and seed it records the reward and entropy curves and the number of steps until
the 10-step moving average of the per-step mean reward reaches the target (0.8), and writes everything to
`--out` (JSON, rewritten after each setting) with the chosen setting: the fastest one (worst seed counts),
robustness probes excluded, that reached the target within `--step-budget` steps in every seed, and the
job-configuration values it stands for (`recommended_dev_yaml`). `heldout_greedy_accuracy` is the greedy
accuracy on the task's evaluation problems: problems never trained on, but of the same mapping (for copy_first
with 5 values, the answer is one of the 5 first values seen in training), so it is an in-distribution check and
does not measure generalisation.

    python benchmarks/learnability.py --out benchmarks/results/learnability.json
    python benchmarks/learnability.py --settings copy_first_bs32_tokens2 --merge   # add one more candidate
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from libra.algo.advantages import compute_advantages
from libra.algo.grpo import LossInputs, grpo_loss
from libra.algo.spec import AlgorithmSpec
from libra.config import mapping
from libra.config.sections import AlgorithmConfig, ISCorrectionConfig, RefKLConfig, TinyModelConfig
from libra.data import Prompt, Task, TaskSpec, build_task
from libra.models.tiny import TinyModelSpec, build_tiny_model

TARGET = 0.8
WINDOW = 10
# The model shape of a setting that names none (hidden 64: about 0.2M parameters).
BASE_SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=512)


def tiny_spec(setting_model: dict[str, Any], **changes: Any) -> TinyModelSpec:
    return mapping.tiny_model_spec(TinyModelConfig(**{**BASE_SHAPE, **setting_model, **changes}))


@dataclass(frozen=True)
class Setting:
    """One candidate: task, model shape and the RL hyperparameters, named as in the job configuration."""

    name: str
    task: str = "copy_first"
    task_params: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    lr: float = 3e-3
    batch_size: int = 16
    n_samples: int = 8
    max_new_tokens: int = 1
    temperature: float = 1.0
    advantage_norm_mode: str = "group_zscore"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    entropy_coef: float = 0.0
    ref_kl_coef: float = 0.0
    updates_per_batch: int = 1
    clip_grad: float = 0.0  # Megatron-Core on CPU cannot clip gradients
    weight_decay: float = 0.0
    policy_lag: int = 0
    recompute_logprobs: bool = True
    is_correction: bool = False  # truncated importance weights (algorithm.is_correction, token level, clip)
    probe: bool = False  # a robustness probe of another setting, never the recommendation


_COPY_FIRST = Setting(
    name="copy_first_bs32",
    task="copy_first",
    task_params={"num_values": 5, "length": 3, "format_reward": 0.1},
    lr=3e-3,
    batch_size=32,
    n_samples=8,
    max_new_tokens=1,
    entropy_coef=0.1,
)

CANDIDATES: dict[str, Setting] = {
    s.name: s
    for s in [
        _COPY_FIRST,
        replace(_COPY_FIRST, name="copy_first_bs16", batch_size=16),
        replace(_COPY_FIRST, name="copy_first_bs32_lag1", policy_lag=1, probe=True),
        replace(
            _COPY_FIRST,
            name="copy_first_bs32_lag1_rollout_logp",
            policy_lag=1,
            recompute_logprobs=False,
            probe=True,
        ),
        replace(_COPY_FIRST, name="copy_first_bs32_lag1_is", policy_lag=1, is_correction=True, probe=True),
        replace(_COPY_FIRST, name="copy_first_bs32_tokens2", max_new_tokens=2),
        replace(
            _COPY_FIRST,
            name="copy_first_bs32_no_shaping",
            task_params={"num_values": 5, "length": 3, "format_reward": 0.0},
        ),
        replace(_COPY_FIRST, name="copy_first_bs32_lr6e-3", lr=6e-3),
        replace(_COPY_FIRST, name="copy_first_bs32_heads2", model={"num_heads": 2, "num_kv_heads": 1}),
        replace(
            _COPY_FIRST,
            name="copy_first_bs32_hidden128",
            model={"hidden_size": 128, "intermediate_size": 256},
        ),
        replace(
            _COPY_FIRST,
            name="mod_add_m5_bs32",
            task="mod_add",
            task_params={"modulus": 5, "format_reward": 0.1},
            lr=1e-3,
            entropy_coef=0.05,
        ),
    ]
}
# what the default invocation runs (every candidate); a subset runs with --settings A,B --merge
DEFAULT_STUDY = tuple(CANDIDATES)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq) :] = torch.tensor(seq)
        mask[row, width - len(seq) :] = 1
    return ids, mask


def logits_of(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits  # type: ignore[no-any-return]


@torch.no_grad()
def sample(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    greedy: bool = False,
) -> list[list[int]]:
    """Responses (token ids, stopping after EOS) for each prompt, sampled like the inference server does."""
    responses: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        ids, mask = left_pad([p + r for p, r in zip(prompts, responses, strict=True)], pad_id)
        last = logits_of(model, ids, mask)[:, -1, :].float()
        if greedy:
            tokens = last.argmax(dim=-1)
        else:
            tokens = torch.multinomial(torch.softmax(last / temperature, dim=-1), 1).squeeze(1)
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                responses[row].append(token)
                done[row] = token == eos_id
        if all(done):
            break
    return responses


def response_logprobs(
    model: Any, prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p of each response token, entropy at each response position, 0/1 mask), all [rows, tokens]."""
    ids, attn = left_pad([p + r for p, r in zip(prompts, responses, strict=True)], pad_id)
    width, longest = ids.shape[1], max(len(r) for r in responses)
    lengths = torch.tensor([len(r) for r in responses])
    steps = torch.arange(longest)
    # response token k of a row sits at width - len + k and is predicted from the position before it
    positions = (width - lengths.unsqueeze(1) + steps.unsqueeze(0) - 1).clamp(0, width - 1)
    mask = (steps.unsqueeze(0) < lengths.unsqueeze(1)).float()
    targets = torch.tensor([r + [pad_id] * (longest - len(r)) for r in responses])
    logits = logits_of(model, ids, attn).float()
    picked = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    logp_all = torch.log_softmax(picked, dim=-1)
    logp = logp_all.gather(2, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy, mask


def algorithm_spec(setting: Setting) -> AlgorithmSpec:
    """The loss settings a job with the setting's `algorithm` section runs (the rest at the job defaults)."""
    return mapping.algorithm_spec(AlgorithmConfig(
        advantage_norm_mode=setting.advantage_norm_mode,  # type: ignore[arg-type]
        clip_ratio_low=setting.clip_ratio_low,
        clip_ratio_high=setting.clip_ratio_high,
        entropy_coef=setting.entropy_coef,
        ref_kl=RefKLConfig(enable=setting.ref_kl_coef > 0, coef=setting.ref_kl_coef, kl_type="k3"),
        is_correction=ISCorrectionConfig(enable=setting.is_correction),
    ))


def batches(stream: Iterator[Prompt], size: int) -> Iterator[list[Prompt]]:
    while True:
        yield [next(stream) for _ in range(size)]


def moving_average(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i + 1 - window) : i + 1]) / len(values[max(0, i + 1 - window) : i + 1])
        for i in range(len(values))
    ]


def run(setting: Setting, seed: int, max_steps: int, work_dir: str) -> dict[str, Any]:
    """One GRPO run; stops early once the moving-average reward has stayed at the target for a window."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_spec = tiny_spec(setting.model, seed=seed)
    model_dir = build_tiny_model(os.path.join(work_dir, f"{setting.name}-seed{seed}"), model_spec)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    ref_model = copy.deepcopy(model).eval() if setting.ref_kl_coef > 0 else None
    task: Task = build_task(TaskSpec(name=setting.task, params=setting.task_params), tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setting.lr, weight_decay=setting.weight_decay)
    spec = algorithm_spec(setting)
    torch.manual_seed(seed)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    lagged: list[dict[str, torch.Tensor]] = []
    behaviour = copy.deepcopy(model).eval() if setting.policy_lag else model
    rewards_per_step: list[float] = []
    entropy_per_step: list[float] = []
    reached_at: int | None = None
    started, cpu_started = time.perf_counter(), time.process_time()
    stream = batches(task.train_prompts(seed), setting.batch_size)
    for step in range(1, max_steps + 1):
        prompts = next(stream)
        prompt_ids = [p.token_ids for p in prompts for _ in range(setting.n_samples)]
        if setting.policy_lag:
            lagged.append({k: v.clone() for k, v in model.state_dict().items()})
            behaviour.load_state_dict(lagged[0])
            lagged = lagged[-setting.policy_lag :]
        responses = sample(behaviour, prompt_ids, setting.max_new_tokens, setting.temperature, eos_id, pad_id)
        rewards = torch.tensor(
            [
                task.reward(
                    prompts[i // setting.n_samples], r, str(tokenizer.decode(r, skip_special_tokens=True))
                )
                for i, r in enumerate(responses)
            ]
        ).view(setting.batch_size, setting.n_samples)
        adv = torch.tensor(
            compute_advantages(rewards.flatten().tolist(), setting.n_samples, setting.advantage_norm_mode)
        )
        with torch.no_grad():
            rollout_logp, _, _ = response_logprobs(behaviour, prompt_ids, responses, pad_id)
            recompute = setting.recompute_logprobs and behaviour is not model
            old_logp = (
                response_logprobs(model, prompt_ids, responses, pad_id)[0] if recompute else rollout_logp
            )
        order = torch.randperm(len(responses))
        for chunk in order.chunk(setting.updates_per_batch):
            idx = chunk.tolist()
            rows_p, rows_r = [prompt_ids[i] for i in idx], [responses[i] for i in idx]
            logp, entropy, mask = response_logprobs(model, rows_p, rows_r, pad_id)
            ref_logp = None
            if ref_model is not None:
                with torch.no_grad():
                    ref_logp = response_logprobs(ref_model, rows_p, rows_r, pad_id)[0]
            width = logp.shape[1]
            inputs = LossInputs(
                logp=logp,
                old_logp=old_logp[idx, :width],
                rollout_logp=rollout_logp[idx, :width],
                advantages=adv[idx],
                mask=mask,
                entropy=entropy,
                ref_logp=ref_logp,
            )
            loss = grpo_loss(inputs, spec, use_is=setting.is_correction)
            optimizer.zero_grad()
            loss.backward()
            if setting.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip_grad)
            optimizer.step()
        entropy_per_step.append(float((entropy.detach() * mask).sum() / mask.sum()))
        rewards_per_step.append(float(rewards.mean()))
        ma = moving_average(rewards_per_step[-WINDOW:], WINDOW)[-1]
        if reached_at is None and step >= WINDOW and ma >= TARGET:
            reached_at = step
        if reached_at is not None and step >= reached_at + WINDOW:
            break
    eval_prompts = task.eval_prompts(0)
    model.eval()
    greedy = sample(
        model, [p.token_ids for p in eval_prompts], setting.max_new_tokens, 1.0, eos_id, pad_id, greedy=True
    )
    eval_acc = sum(
        task.reward(p, r, str(tokenizer.decode(r, skip_special_tokens=True))) >= 1.0
        for p, r in zip(eval_prompts, greedy, strict=True)
    )
    return {
        "seed": seed,
        "steps_to_target": reached_at,
        "steps_run": len(rewards_per_step),
        "initial_reward": sum(rewards_per_step[:WINDOW]) / min(WINDOW, len(rewards_per_step)),
        "final_moving_average": moving_average(rewards_per_step, WINDOW)[-1],
        "heldout_greedy_accuracy": eval_acc / max(1, len(eval_prompts)),
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(time.process_time() - cpu_started, 2),
        "reward_curve": [round(r, 4) for r in rewards_per_step],
        "entropy_curve": [round(e, 3) for e in entropy_per_step],
    }


def recommend_dev_yaml(setting: Setting, worst_steps: int) -> dict[str, Any]:
    """The job-configuration values of a setting; `total_steps` is about three times the worst seed's need."""
    model = asdict(tiny_spec(setting.model))
    for key in ("seed", "tie_word_embeddings"):  # the job's seed; untied is the only choice of the config
        model.pop(key)
    return {
        "task": {"name": setting.task, "params": dict(setting.task_params)},
        "build_tiny_model": model,
        "batch_size": setting.batch_size,
        "n_samples": setting.n_samples,
        "max_new_tokens": setting.max_new_tokens,
        "rollout_temperature": setting.temperature,
        "total_steps": max(50, round(3 * worst_steps / 50) * 50),
        "recompute_logprobs": setting.recompute_logprobs,
        "max_head_offpolicyness": setting.policy_lag,
        "algorithm": {
            "advantage_norm_mode": setting.advantage_norm_mode,
            "clip_ratio_low": setting.clip_ratio_low,
            "clip_ratio_high": setting.clip_ratio_high,
            "entropy_coef": setting.entropy_coef,
            "ref_kl": {"enable": setting.ref_kl_coef > 0, "coef": setting.ref_kl_coef, "kl_type": "k3"},
            "is_correction": {"enable": setting.is_correction},
        },
        "optimizer": {
            "lr": setting.lr,
            "lr_decay_style": "constant",
            "weight_decay": setting.weight_decay,
            "clip_grad": setting.clip_grad,
        },
    }


def summarize(setting: Setting, runs: list[dict[str, Any]], step_budget: int) -> dict[str, Any]:
    steps = [r["steps_to_target"] for r in runs]
    worst = max((s if s is not None else math.inf) for s in steps)
    return {
        "setting": asdict(setting),
        "seeds": [r["seed"] for r in runs],
        "steps_to_target": steps,
        "worst_steps_to_target": None if worst == math.inf else worst,
        "reached_in_every_seed_within_budget": worst <= step_budget,
        "runs": runs,
    }


def choose(results: dict[str, Any]) -> str | None:
    """The fastest non-probe setting (worst seed counts) that reached the target within budget in every seed."""
    passing = [
        n
        for n, r in results.items()
        if r["reached_in_every_seed_within_budget"] and not r["setting"]["probe"]
    ]
    return min(passing, key=lambda n: results[n]["worst_steps_to_target"]) if passing else None


def write_report(path: str, args: argparse.Namespace, results: dict[str, Any]) -> str | None:
    chosen = choose(results)
    recommended = (
        recommend_dev_yaml(CANDIDATES[chosen], results[chosen]["worst_steps_to_target"]) if chosen else None
    )
    report = {
        "target_moving_average_reward": TARGET,
        "moving_average_window": WINDOW,
        "step_budget": args.step_budget,
        "max_steps": args.max_steps,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs",
        "torch": torch.__version__,
        "runs_wall_s": round(sum(run["wall_s"] for r in results.values() for run in r["runs"]), 1),
        "runs_cpu_s": round(sum(run["cpu_s"] for r in results.values() for run in r["runs"]), 1),
        "chosen": chosen,
        "recommended_dev_yaml": recommended,
        "settings": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/learnability.json")
    parser.add_argument("--settings", default=",".join(DEFAULT_STUDY), help="comma-separated candidate names")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument(
        "--step-budget", type=int, default=150, help="steps a setting may need, in every seed"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--merge", action="store_true", help="keep the other settings already in --out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; choose from {sorted(CANDIDATES)}")
    results: dict[str, Any] = {}
    if args.merge and os.path.isfile(args.out):
        with open(args.out, encoding="utf-8") as fh:
            results = {k: v for k, v in json.load(fh)["settings"].items() if k in CANDIDATES}
    with tempfile.TemporaryDirectory(prefix="libra-learnability-") as work_dir:
        for name in names:
            runs = []
            for seed in seeds:
                result = run(CANDIDATES[name], seed, args.max_steps, work_dir)
                runs.append(result)
                print(
                    f"{name} seed {seed}: steps_to_{TARGET}={result['steps_to_target']} "
                    f"final_ma={result['final_moving_average']:.3f} eval={result['heldout_greedy_accuracy']:.2f} "
                    f"{result['wall_s']}s wall, {result['cpu_s']}s cpu",
                    file=sys.stderr,
                    flush=True,
                )
            results[name] = summarize(CANDIDATES[name], runs, args.step_budget)
            write_report(args.out, args, results)
    chosen = write_report(args.out, args, results)
    print(f"chosen: {chosen}; wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
