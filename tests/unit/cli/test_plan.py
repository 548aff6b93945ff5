"""`libra plan`: every example configuration, held-out model files, an impossible 405B job, JSON and explain."""

from __future__ import annotations

import glob
import json
import os
import time

import pytest

from libra.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))

HELD_OUT = {  # architecture facts of public models that are not in the repository
    "llama-3.1-70b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                      "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
                      "rope_theta": 500000.0, "tie_word_embeddings": False},
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 32768, "max_position_embeddings": 32768,
                   "sliding_window": None, "tie_word_embeddings": False},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "vocab_size": 32000, "max_position_embeddings": 32768, "tie_word_embeddings": False},
}
LLAMA_405B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384,
              "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "tie_word_embeddings": False}


def write_job(tmp_path, name: str, arch: dict, nodes: int, gpu: str = "H100", extra: str = "") -> str:  # type: ignore[no-untyped-def]
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(arch))
    job = tmp_path / f"{name}.yaml"
    job.write_text(f"model_path: {name}\ncluster: {{num_nodes: {nodes}, gpus_per_node: 8, gpu_type: {gpu}}}\n"
                   "batch_size: 32\nn_samples: 8\nmax_model_len: 4096\nmax_new_tokens: 2048\n"
                   "max_head_offpolicyness: 1\nmegatron_use_distributed_optimizer: true\n"
                   "megatron_recompute_granularity: full\n" + extra)
    return str(job)


@pytest.mark.parametrize("config", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_every_example_config_gets_an_answer_quickly(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.process_time()
    code = main(["plan", config])
    cpu = time.process_time() - started
    out = capsys.readouterr().out
    assert code in (0, 2)
    assert out.startswith("Plan for")
    assert ("Chosen split" in out) if code == 0 else ("What to change" in out)
    assert cpu < 2.0, f"{config}: {cpu:.2f} s of CPU"


@pytest.mark.parametrize("config", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_json_output_is_the_documented_document(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", config, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1
    assert doc["feasible"] == (code == 0)
    if doc["feasible"]:
        chosen = doc["chosen"]
        assert chosen["train"]["gpus"] + chosen["rollout"]["gpus"] <= doc["cluster"]["total_gpus"]
        assert chosen["memory"]["train"]["peak_bytes"] <= chosen["memory"]["train"]["capacity_bytes"]
    else:
        assert doc["suggestions"]


@pytest.mark.parametrize("name", HELD_OUT)
def test_held_out_models_plan(name: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    job = write_job(tmp_path, name, HELD_OUT[name], nodes={"llama-3.1-70b": 8, "mixtral-8x7b": 4}.get(name, 1))
    code = main(["plan", job, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc["suggestions"]
    assert doc["model"]["layers"] == HELD_OUT[name]["num_hidden_layers"]
    assert doc["chosen"]["throughput"]["samples_per_s"] > 0


def test_405b_on_one_node_exits_2_with_a_memory_explanation(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    job = write_job(tmp_path, "llama-3.1-405b", LLAMA_405B, nodes=1)
    code = main(["plan", job])
    out = capsys.readouterr().out
    assert code == 2
    assert "No feasible plan" in out
    assert "memory: the training state alone (405.9 B params" in out
    assert "rollout TP 8" in out


def test_explain_lists_every_pruned_candidate(capsys: pytest.CaptureFixture[str]) -> None:
    config = os.path.join(ROOT, "configs", "qwen2.5-7b-8gpu.yaml")
    assert main(["plan", config, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "Pruned candidates" in out and "split_divisibility" in out
    assert main(["plan", config, "--json", "--explain"]) == 0
    doc = json.loads(capsys.readouterr().out)
    total = sum(len(p["train_gpus"]) if p["train_gpus"] != "all" else 1 for p in doc["pruned"])
    assert total >= 1 and {p["code"] for p in doc["pruned"]} >= set(doc["pruned_counts"])


def test_set_overrides_and_configured_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    config = os.path.join(ROOT, "configs", "qwen2.5-7b-8gpu.yaml")
    code = main(["plan", config, "--json", "--set", "global_resource_planner.initial_allocation_strategy=configured"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["strategy"] == "configured"
    assert (doc["chosen"]["train"]["gpus"], doc["chosen"]["train"]["tp"]) == (4, 2)


def test_invalid_configuration_exits_2(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    job = write_job(tmp_path, "mistral-7b", HELD_OUT["mistral-7b"], nodes=1, extra="batch_size: 0\n")
    assert main(["plan", job]) == 2
    assert "batch_size" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["mistral-7b", "mixtral-8x7b"])
def test_a_model_training_cannot_run_plans_but_never_launches(name: str, tmp_path,  # type: ignore[no-untyped-def]
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Planning a job for a model Libra cannot train yet is legitimate (a warning names what is missing);
    `libra validate` and `libra launch` refuse it as Not implemented before anything starts."""
    job = write_job(tmp_path, name, HELD_OUT[name], nodes=4)
    missing = "training has no HF <-> Megatron-Core weight conversion for it"
    assert main(["plan", job, "--json"]) == 0
    err = capsys.readouterr().err
    assert missing in err and "[model.runnable]" in err
    for command in (["validate", job], ["launch", job, "--run-dir", str(tmp_path / "run")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"Not implemented: model_path = \"{tmp_path / name}\": model_type '{HELD_OUT[name]['model_type']}'" in err
        assert missing in err
    assert not (tmp_path / "run").exists()
