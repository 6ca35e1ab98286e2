"""transformers sampling the prompts of a `llama sample` data set, batched the same way: the
reference side of `scripts/bench_sample.sh`.

    python sample_hf.py MODEL_DIR DATA.jsonl --samples 4 --batch-prompts 4 --max-new-tokens 128

Reads each prompt's token ids from DATA.jsonl (the first line of each id, in file order), repeats
each prompt `--samples` times, and generates batches of `--batch-prompts × --samples` rows
(left-padded, `do_sample=True`, temperature 1, no top-k or top-p, the model's end-of-sequence
tokens), as `llama sample` batches them by default. Prints one JSON line: completions, generated
tokens (each row up to and including its first end-of-sequence token), the generation's seconds
(the model's load excluded) and tokens per second.
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("data")
p.add_argument("--samples", type=int, default=4)
p.add_argument("--batch-prompts", type=int, default=4)
p.add_argument("--max-new-tokens", type=int, default=128)
p.add_argument("--eos", default="", help="comma-separated end-of-sequence ids (default: the model's)")
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()

prompts, seen = [], set()
with open(a.data) as f:
    for line in f:
        r = json.loads(line)
        if r["id"] not in seen:
            seen.add(r["id"])
            prompts.append(r["prompt_ids"])

model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32).eval()
gc = model.generation_config
eos = [int(x) for x in a.eos.split(",") if x] or (
    gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
)
pad = eos[0]
torch.manual_seed(a.seed)
rows = [q for q in prompts for _ in range(a.samples)]
step = a.batch_prompts * a.samples
tokens = 0
t0 = time.perf_counter()
with torch.no_grad():
    for i in range(0, len(rows), step):
        batch = rows[i : i + step]
        width = max(len(r) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in batch])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
        cfg = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=a.max_new_tokens,
            eos_token_id=eos, pad_token_id=pad,
        )
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, width:]
        for row in out.tolist():
            n = len(row)
            for k, t in enumerate(row):
                if t in eos:
                    n = k + 1
                    break
            tokens += n
secs = time.perf_counter() - t0
print(json.dumps({"impl": "transformers", "completions": len(rows), "tokens": tokens, "seconds": secs,
                  "tokens_per_s": tokens / secs}))
