"""Training layouts (TP x PP x CP x EP, virtual stages) and the divisibility rules that do not depend on how
many GPUs the training pool gets, each with a reason code and a message naming the rule.

Rank order is Megatron-Core's default ``tp-cp-ep-dp-pp`` (TP fastest): a TP group spans ``tp`` consecutive
GPUs, a CP group ``tp*cp``, an EP group ``tp*ep`` (expert tensor parallel = TP), a DP group ``tp*cp*dp``.
Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.model_spec import ModelSpec


@dataclass(frozen=True, order=True)
class TrainLayout:
    """Model-parallel degrees of the training pool (DP follows from the pool size)."""

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

    def describe(self, gpus: int) -> str:
        return f"TP{self.tp} PP{self.pp} CP{self.cp} EP{self.ep} DP{self.dp(gpus)}"

    def label(self) -> str:
        text = f"tp={self.tp} pp={self.pp} cp={self.cp} ep={self.ep}"
        return text + (f" vpp={self.vpp}" if self.vpp > 1 else "")

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "vpp": self.vpp}


@dataclass(frozen=True)
class Rule:
    """A failed rule: stable code and a message that says what to change."""

    code: str
    message: str


def layout_rule_violation(spec: ModelSpec, layout: TrainLayout, gpus_per_node: int, max_model_len: int,
                          attention_backend: str) -> Rule | None:
    """First structural rule `layout` breaks for this model and node size, or None."""
    tp, pp, cp, ep, vpp = layout.tp, layout.pp, layout.cp, layout.ep, layout.vpp
    if spec.num_attention_heads % tp:
        return Rule("tp_heads", f"TP {tp} does not divide the {spec.num_attention_heads} attention heads")
    if spec.num_kv_heads % tp:
        return Rule("tp_kv_heads", f"TP {tp} does not divide the {spec.num_kv_heads} KV heads (query groups)")
    if tp > gpus_per_node or gpus_per_node % tp:
        return Rule("tp_node", f"TP {tp} would span nodes of {gpus_per_node} GPUs; TP stays inside a node")
    if vpp > 1 and pp == 1:
        return Rule("vpp_needs_pp", f"{vpp} virtual stages need pipeline parallelism (PP > 1)")
    if spec.num_layers % (pp * vpp):
        return Rule("pp_layers", f"PP {pp} x virtual stages {vpp} does not divide the {spec.num_layers} layers")
    if ep > 1 and not spec.is_moe:
        return Rule("ep_dense", f"EP {ep} needs a mixture-of-experts model; this one is dense")
    if spec.is_moe and spec.num_experts % ep:
        return Rule("ep_experts", f"EP {ep} does not divide the {spec.num_experts} experts")
    if cp > 1 and max_model_len % (2 * cp):
        return Rule("cp_sequence", f"CP {cp} needs max_model_len ({max_model_len}) divisible by 2*CP")
    if cp > 1 and attention_backend != "flash":
        return Rule("cp_backend", f"CP {cp} needs a flash attention backend (ring attention)")
    return None


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
