"""Build the model the TP=2 rows of docs/benchmarks.md run: SmolLM2-135M's size, with KV heads that split over two
ranks (SmolLM2's 9 query and 3 KV heads do not), random weights (seed 0), SmolLM2's tokenizer, float32.

    .venv-vllm/bin/python benchmarks/tp_split_model.py /tmp/smollm2-sized-tp   # prints the directory

Random weights make the timings those of a SmolLM2-sized model; its answers mean nothing (the TTFT rows check only
that a load leaves the greedy tokens as the cold run made them).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvstore.models import default_model_cache_dir
from kvstore.models.vllm_export import export_smollm2_for_vllm

CONFIG = {
    "vocab_size": 49152,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def main(target: Path) -> None:
    if (target / "config.json").exists():
        print(target)
        return
    tokenizer_dir = export_smollm2_for_vllm(default_model_cache_dir(os.environ))
    config = LlamaConfig(**CONFIG)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, target / name)
    print(target)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
