"""Training layouts (TP x PP x CP x EP, virtual stages): the one place parallel sizes are derived and checked.

`TrainLayout.problems` returns every rule a layout breaks for a model, a pool size, a node size and a context
length, each with a stable code, the degree to change and a message printing every factor. Validation
(`libra/config/checks_layout.py`), the planner (`planner/search.py`) and the training pool
(`libra/training/spec.py`) all ask it, so they give the same verdict.

Rank order is Megatron-Core's default ``tp-cp-ep-dp-pp`` (TP fastest): a TP group spans ``tp`` consecutive
GPUs, a CP group ``tp*cp``, an EP group ``tp*ep`` (expert tensor parallel = TP), a DP group ``tp*cp*dp``.
Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.model_spec import ModelSpec


@dataclass(frozen=True)
class Rule:
    """A failed rule: stable code, a message with every factor involved, and the degree it concerns
    (`tp`, `pp`, `vpp`, `cp`, `ep`, or `world` for the pool size; empty for rules outside the layout)."""

    code: str
    message: str
    degree: str = ""


@dataclass(frozen=True, order=True)
class TrainLayout:
    """Parallel degrees of the training pool (torchtitan's `ParallelDims` is the model): DP follows from the pool
    size, DP = world / (TP x PP x CP); EP is carved out of DP x CP (expert tensor parallel = TP)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1

    @property
    def model_parallel(self) -> int:
        """GPUs in one model replica: tp * pp * cp (EP folds into the data-parallel dimension)."""
        return self.tp * self.pp * self.cp

    def dp(self, gpus: int) -> int:
        """Data-parallel replicas of a pool of `gpus` GPUs."""
        return gpus // self.model_parallel if self.model_parallel else 0

    def dims(self, world: int) -> dict[str, int]:
        """Every size of a pool of `world` GPUs, DP included."""
        return {"world": world, **self.as_dict(), "dp": self.dp(world)}

    def describe(self, gpus: int) -> str:
        return f"TP{self.tp} PP{self.pp} CP{self.cp} EP{self.ep} DP{self.dp(gpus)}"

    def label(self) -> str:
        text = f"tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep}"
        return text + (f" vpp={self.vpp}" if self.vpp > 1 else "")

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "vpp": self.vpp}

    def problems(self, model: ModelSpec | None = None, world: int | None = None, gpus_per_node: int | None = None,
                 max_model_len: int | None = None, attention_backend: str | None = None) -> list[Rule]:
        """Every rule this layout breaks, in a fixed order (the planner records the first as the reason).

        Each check runs when its facts are given: the model's heads, layers and experts; `world` (the pool
        size: DP and the expert layout); `gpus_per_node`; `max_model_len` and `attention_backend` (CP)."""
        tp, pp, cp, ep, vpp = self.tp, self.pp, self.cp, self.ep, self.vpp
        small = [Rule("degree_positive", f"{name.upper()} {value} must be >= 1", name)
                 for name, value in self.as_dict().items() if value < 1]
        if world is not None and world < 1:
            small.append(Rule("degree_positive", f"the pool size {world} must be >= 1", "world"))
        if small:
            return small
        found: list[Rule] = []
        if model is not None:
            if model.num_attention_heads % tp:
                found.append(Rule("tp_heads", f"TP {tp} does not divide the {model.num_attention_heads} attention "
                                  "heads", "tp"))
            if model.num_kv_heads % tp:
                found.append(Rule("tp_kv_heads", f"TP {tp} does not divide the {model.num_kv_heads} KV heads "
                                  "(query groups)", "tp"))
        if gpus_per_node is not None and (tp > gpus_per_node or gpus_per_node % tp):
            found.append(Rule("tp_node", f"TP {tp} would span nodes of {gpus_per_node} GPUs (TP stays inside a node)",
                              "tp"))
        if vpp > 1 and pp == 1:
            found.append(Rule("vpp_needs_pp", f"{vpp} virtual stages need pipeline parallelism (PP > 1)", "vpp"))
        if model is not None:
            if model.num_layers % (pp * vpp):
                found.append(Rule("pp_layers", f"PP {pp} x virtual stages {vpp} = {pp * vpp} does not divide the "
                                  f"{model.num_layers} layers", "pp"))
            if ep > 1 and not model.is_moe:
                found.append(Rule("ep_dense", f"EP {ep} needs a mixture-of-experts model ({model.name} is dense)", "ep"))
            if model.is_moe and model.num_experts % ep:
                found.append(Rule("ep_experts", f"EP {ep} does not divide the {model.num_experts} experts", "ep"))
        if cp > 1 and max_model_len is not None and max_model_len % (2 * cp):
            found.append(Rule("cp_sequence", f"CP {cp} needs max_model_len ({max_model_len}) divisible by 2 x CP = "
                              f"{2 * cp}", "cp"))
        if cp > 1 and attention_backend is not None and attention_backend != "flash":
            found.append(Rule("cp_backend", f"CP {cp} needs a flash attention backend (ring attention)", "cp"))
        if world is not None:
            found += self.world_problems(world)
        return found

    def world_problems(self, world: int) -> list[Rule]:
        """What a pool of `world` GPUs breaks: DP = world / (TP x PP x CP) must be whole, and Megatron-Core
        lays EP x TP ranks inside each pipeline stage's world / PP = TP x CP x DP ranks, so EP divides DP x CP."""
        tp, pp, cp, ep, mp = self.tp, self.pp, self.cp, self.ep, self.model_parallel
        if world % mp:
            return [Rule("split_divisibility", f"TP x PP x CP = {tp} x {pp} x {cp} = {mp} does not divide the "
                         f"{world} training GPUs (DP = GPUs / (TP x PP x CP))", "world")]
        dp = world // mp
        if (dp * cp) % ep:
            return [Rule("ep_data_parallel", f"EP {ep} does not divide DP x CP = {dp} x {cp} = {dp * cp}: "
                         f"Megatron-Core places EP x TP = {ep * tp} ranks inside the GPUs of one pipeline stage "
                         f"({world} / PP {pp} = {world // pp})", "ep")]
        return []


def layout_rule_violation(spec: ModelSpec, layout: TrainLayout, gpus_per_node: int, max_model_len: int,
                          attention_backend: str) -> Rule | None:
    """First structural rule `layout` breaks for this model and node size, or None."""
    found = layout.problems(spec, gpus_per_node=gpus_per_node, max_model_len=max_model_len,
                            attention_backend=attention_backend)
    return found[0] if found else None


def group_is_intra_node(span: Any, gpus_per_node: int) -> Any:
    """A group of consecutive ranks spanning `span` GPUs (int or array) stays inside one node when it fits."""
    return span <= gpus_per_node


def enumerate_layouts(allowed_tp: tuple[int, ...], allowed_pp: tuple[int, ...], allowed_cp: tuple[int, ...],
                      allowed_ep: tuple[int, ...], vpp: int) -> list[TrainLayout]:
    """Every combination of the allowed degrees, in a fixed order (the search is deterministic)."""
    layouts = []
    for tp in sorted(set(allowed_tp)):
        for pp in sorted(set(allowed_pp)):
            for cp in sorted(set(allowed_cp)):
                for ep in sorted(set(allowed_ep)):
                    layouts.append(TrainLayout(tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp if pp > 1 else 1))
    return layouts


def rollout_rule_violation(spec: ModelSpec, rollout_tp: int, gpus_per_node: int) -> Rule | None:
    """vLLM's tensor-parallel constraints for one rollout instance."""
    if spec.num_attention_heads % rollout_tp:
        return Rule("rollout_tp_heads",
                    f"rollout TP {rollout_tp} does not divide the {spec.num_attention_heads} attention heads")
    if spec.num_kv_heads % rollout_tp and rollout_tp % spec.num_kv_heads:
        return Rule("rollout_tp_kv_heads",
                    f"rollout TP {rollout_tp} neither divides nor is a multiple of the {spec.num_kv_heads} KV heads")
    if rollout_tp > gpus_per_node or gpus_per_node % rollout_tp:
        return Rule("rollout_tp_node", f"rollout TP {rollout_tp} would span nodes of {gpus_per_node} GPUs")
    return None
