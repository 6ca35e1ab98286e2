#!/usr/bin/env python3
"""Times a forward and backward pass of a Llama checkpoint on two sampled sequences with subnormal
floats kept, flushed, then kept again (PyTorch, one thread): how much a collapsed policy's
subnormal probabilities slow the CPU (examples/llama/src/subnormal.rs has the figures).

    source scripts/env.sh
    "$TOPR_REFERENCE_PYTHON" scripts/subnormals.py WEIGHTS.safetensors DATA.jsonl [CONFIG_DIR]

WEIGHTS: a model's weights (a training state's `model.safetensors`, say: the study's naive
REINFORCE arm late in its training); DATA: a data set of `llama sample` (its first two
completions are used, cut to the shorter); CONFIG_DIR: the model's Hugging Face folder (default
models/smollm2-135m-instruct). A reference measurement: the library does not run Python.
"""
import json
import sys
import time

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM


def main():
    weights, data = sys.argv[1], sys.argv[2]
    config = sys.argv[3] if len(sys.argv) > 3 else "models/smollm2-135m-instruct"
    torch.set_num_threads(1)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(config))
    # SmolLM2 ties the output head to the embeddings: the head's weight is not in the file.
    model.load_state_dict(load_file(weights), strict=False)
    with open(data) as f:
        rows = [json.loads(line) for line, _ in zip(f, range(2))]
    ids = [r["prompt_ids"] + r["completion_ids"] for r in rows]
    t = min(len(s) for s in ids)
    x = torch.tensor([s[:t] for s in ids])
    for flush in (False, True, False):
        torch.set_flush_denormal(flush)
        model.zero_grad()
        start = time.perf_counter()
        logits = model(x).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None]).squeeze(-1)
        (-logp.sum()).backward()
        took = time.perf_counter() - start
        print(f"subnormals {'flushed' if flush else 'kept'}: {took:.2f} s (mean log-prob {logp.mean().item():.2f}, {t} tokens)")


if __name__ == "__main__":
    main()
