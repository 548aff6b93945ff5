"""Learnability study: how many GRPO steps a tiny random model needs to learn a built-in task.

A single-process, pure-torch mirror of what the real pipeline does each step: take `batch_size` prompts from
the task (libra.data, the same code the controller uses), sample `n_samples` responses of at most
`max_new_tokens` tokens per prompt at temperature 1 (optionally from a policy `policy_lag` steps old, like
asynchronous rollouts), score them with the task's reward, normalize advantages per group, then take
`updates_per_batch` AdamW steps on the PPO-clip loss with an entropy bonus and a KL-to-reference term.

For every candidate setting and seed it records the reward curve and the number of steps until the moving
average of the per-step mean reward reaches the target (0.8), and writes everything to `--out` (JSON) with
the chosen setting: the fastest one that reached the target within `--step-budget` steps in every seed.

    python benchmarks/learnability.py --out benchmarks/results/learnability.json
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

from libra.data import Prompt, Task, TaskSpec, build_task
from libra.models.tiny import TinyModelSpec, build_tiny_model

TARGET = 0.8
WINDOW = 10


@dataclass(frozen=True)
class Setting:
    """One candidate: task, model shape and the RL hyperparameters, named as in the job configuration."""

    name: str
    task: str = "mod_add"
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
    clip_grad: float = 1.0
    weight_decay: float = 0.0
    policy_lag: int = 0


CANDIDATES: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("mod_add_m5", task_params={"modulus": 5, "format_reward": 0.1}, entropy_coef=0.01),
    ]
}


def advantages(rewards: torch.Tensor, mode: str, eps: float = 1e-6) -> torch.Tensor:
    """[groups, n] rewards -> advantages (the modes of algorithm.advantage_norm_mode)."""
    if mode == "none":
        return rewards
    if mode.startswith("group"):
        centered = rewards - rewards.mean(dim=1, keepdim=True)
        std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.ones_like(rewards[:, :1])
    else:
        centered = rewards - rewards.mean()
        std = rewards.std() if rewards.numel() > 1 else torch.ones(())
    return centered / (std + eps) if mode.endswith("zscore") else centered


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
    model: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos_id: int, pad_id: int,
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


def grpo_loss(
    model: Any, ref_model: Any | None, prompts: list[list[int]], responses: list[list[int]],
    old_logprobs: list[torch.Tensor], adv: torch.Tensor, s: Setting, pad_id: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean PPO-clip loss - entropy_coef * entropy + ref_kl_coef * k3 KL over the response tokens."""
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    ids, mask = left_pad(seqs, pad_id)
    logits = logits_of(model, ids, mask)
    width = ids.shape[1]
    # positions whose next token is a response token
    rows, cols, targets, advs, olds = [], [], [], [], []
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        start = width - len(p) - len(r)
        for k, token in enumerate(r):
            rows.append(row)
            cols.append(start + len(p) - 1 + k)
            targets.append(token)
            advs.append(float(adv[row]))
            olds.append(float(old_logprobs[row][k]))
    row_t, col_t = torch.tensor(rows), torch.tensor(cols)
    token_logits = logits[row_t, col_t].float()
    logp_all = torch.log_softmax(token_logits, dim=-1)
    logp = logp_all.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1)
    adv_t, old_t = torch.tensor(advs), torch.tensor(olds)
    ratio = torch.exp(logp - old_t)
    clipped = ratio.clamp(1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high)
    pg = -torch.minimum(ratio * adv_t, clipped * adv_t).mean()
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1).mean()
    loss = pg - s.entropy_coef * entropy
    kl = torch.zeros(())
    if ref_model is not None and s.ref_kl_coef > 0:
        with torch.no_grad():
            ref_logits = logits_of(ref_model, ids, mask)[row_t, col_t].float()
            ref_logp = torch.log_softmax(ref_logits, dim=-1).gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1)
        log_ratio = ref_logp - logp
        kl = (log_ratio.exp() - log_ratio - 1.0).mean()
        loss = loss + s.ref_kl_coef * kl
    clip_frac = ((ratio - clipped).abs() > 1e-6).float().mean()
    return loss, {"entropy": float(entropy.detach()), "kl": float(kl.detach()), "clip_frac": float(clip_frac)}


def response_logprobs(model: Any, prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> list[torch.Tensor]:
    with torch.no_grad():
        seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
        ids, mask = left_pad(seqs, pad_id)
        logp = torch.log_softmax(logits_of(model, ids, mask).float(), dim=-1)
        width = ids.shape[1]
        out = []
        for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            start = width - len(p) - len(r) + len(p) - 1
            idx = torch.arange(start, start + len(r))
            out.append(logp[row, idx, torch.tensor(r)])
        return out


def batches(stream: Iterator[Prompt], size: int) -> Iterator[list[Prompt]]:
    while True:
        yield [next(stream) for _ in range(size)]


def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i + 1 - window) : i + 1]) / len(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def run(setting: Setting, seed: int, max_steps: int, work_dir: str) -> dict[str, Any]:
    """One GRPO run; stops early once the moving-average reward has stayed at the target for a window."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = TinyModelSpec(**{**setting.model, "seed": seed})
    model_dir = build_tiny_model(os.path.join(work_dir, f"{setting.name}-seed{seed}"), spec)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    ref_model = copy.deepcopy(model).eval() if setting.ref_kl_coef > 0 else None
    task: Task = build_task(TaskSpec(name=setting.task, params=setting.task_params), tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setting.lr, weight_decay=setting.weight_decay)
    torch.manual_seed(seed)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    lagged: list[dict[str, torch.Tensor]] = []
    behaviour = copy.deepcopy(model).eval() if setting.policy_lag else model
    rewards_per_step: list[float] = []
    entropy_per_step: list[float] = []
    reached_at: int | None = None
    started = time.perf_counter()
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
                task.reward(prompts[i // setting.n_samples], r, tokenizer.decode(r))
                for i, r in enumerate(responses)
            ]
        ).view(setting.batch_size, setting.n_samples)
        adv = advantages(rewards, setting.advantage_norm_mode).flatten()
        old = response_logprobs(behaviour, prompt_ids, responses, pad_id)
        order = torch.randperm(len(responses))
        for chunk in order.chunk(setting.updates_per_batch):
            idx = chunk.tolist()
            loss, stats = grpo_loss(
                model, ref_model, [prompt_ids[i] for i in idx], [responses[i] for i in idx],
                [old[i] for i in idx], adv[idx], setting, pad_id,
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), setting.clip_grad)
            optimizer.step()
        rewards_per_step.append(float(rewards.mean()))
        entropy_per_step.append(stats["entropy"])
        ma = moving_average(rewards_per_step[-WINDOW:], WINDOW)[-1]
        if reached_at is None and step >= WINDOW and ma >= TARGET:
            reached_at = step
        if reached_at is not None and step >= reached_at + WINDOW:
            break
    eval_prompts = task.eval_prompts(0)
    model.eval()
    greedy = sample(model, [p.token_ids for p in eval_prompts], setting.max_new_tokens, 1.0, eos_id, pad_id, greedy=True)
    eval_acc = sum(task.reward(p, r, tokenizer.decode(r)) >= 1.0 for p, r in zip(eval_prompts, greedy, strict=True))
    return {
        "seed": seed,
        "steps_to_target": reached_at,
        "steps_run": len(rewards_per_step),
        "initial_reward": sum(rewards_per_step[:WINDOW]) / min(WINDOW, len(rewards_per_step)),
        "final_moving_average": moving_average(rewards_per_step, WINDOW)[-1],
        "heldout_greedy_accuracy": eval_acc / max(1, len(eval_prompts)),
        "wall_s": round(time.perf_counter() - started, 2),
        "reward_curve": [round(r, 4) for r in rewards_per_step],
        "entropy_curve": [round(e, 3) for e in entropy_per_step],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/learnability.json")
    parser.add_argument("--settings", default=",".join(CANDIDATES), help="comma-separated candidate names")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--step-budget", type=int, default=150, help="steps a setting may need, in every seed")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; choose from {sorted(CANDIDATES)}")
    results: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="libra-learnability-") as work_dir:
        for name in names:
            setting = CANDIDATES[name]
            runs = []
            for seed in seeds:
                result = run(setting, seed, args.max_steps, work_dir)
                runs.append(result)
                print(f"{name} seed {seed}: steps_to_{TARGET}={result['steps_to_target']} "
                      f"final_ma={result['final_moving_average']:.3f} eval={result['heldout_greedy_accuracy']:.2f} "
                      f"{result['wall_s']}s", file=sys.stderr, flush=True)
            steps = [r["steps_to_target"] for r in runs]
            worst = max((s if s is not None else math.inf) for s in steps)
            results[name] = {
                "setting": asdict(setting),
                "worst_steps_to_target": None if worst == math.inf else worst,
                "reached_in_every_seed_within_budget": worst <= args.step_budget,
                "runs": runs,
            }
    passing = [n for n in names if results[n]["reached_in_every_seed_within_budget"]]
    chosen = min(passing, key=lambda n: results[n]["worst_steps_to_target"]) if passing else None
    report = {
        "target_moving_average_reward": TARGET,
        "moving_average_window": WINDOW,
        "step_budget": args.step_budget,
        "seeds": seeds,
        "max_steps": args.max_steps,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "total_wall_s": round(time.perf_counter() - started, 1),
        "chosen": chosen,
        "settings": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1)
    print(f"chosen: {chosen}; wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
