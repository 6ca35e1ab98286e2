"""transformers' side of scripts/bench_llama.sh and of the GPU bundle's bench stage: the same
measurements as `llama bench` (greedy fixed-length generation tokens/s at each batch size; the
training step's forward + backward of the mean next-token NLL through the full logits).

usage: python bench_hf.py MODEL_DIR NEW_TOKENS TRAIN_BATCH TRAIN_LEN [--device cpu|cuda]
                          [--dtype f32|bf16] [--gen-batch 1,16] [--mode eager|static-compile]

--mode static-compile measures generation only, with transformers' static KV cache and the
forward compiled by `torch.compile(mode="reduce-overhead")` (which replays CUDA graphs): the
fastest way transformers offers to decode, as its documentation describes it. Two full-length
generations per batch size before the timed one (compilation and graph capture).
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("new_tokens", type=int)
p.add_argument("train_batch", type=int)
p.add_argument("train_len", type=int)
p.add_argument("--device", default="cpu")
p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
p.add_argument("--gen-batch", default="1,16")
p.add_argument("--mode", default="eager", choices=["eager", "static-compile"])
a = p.parse_args()
dev = torch.device(a.device)
dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(dev).eval()
tok = AutoTokenizer.from_pretrained(a.model)
text = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story about a dragon."}], add_generation_prompt=True, tokenize=False)
prompt = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(dev)
impl = "transformers"
if a.mode == "static-compile":
    impl = "transformers-static-compile"
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
for batch in [int(b) for b in a.gen_batch.split(",")]:
    x = prompt.repeat(batch, 1)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        for _ in range(1 if a.mode == "eager" else 2):
            warm = 4 if a.mode == "eager" else a.new_tokens
            model.generate(x, max_new_tokens=warm, min_new_tokens=warm, **kw)
        sync()
        t0 = time.time()
        g = model.generate(x, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, **kw)
        sync()
        secs = time.time() - t0
    n = (g.shape[1] - x.shape[1]) * batch
    print(json.dumps({"what": "generate", "impl": impl, "batch": batch, "new_tokens": a.new_tokens, "seconds": secs, "tokens_per_s": n / secs}), flush=True)
if a.mode != "eager":
    raise SystemExit(0)
model.train()
torch.manual_seed(0)
ids = torch.randint(model.config.vocab_size, (a.train_batch, a.train_len), device=dev)


def step():
    logits = model(input_ids=ids).logits
    lp = logits[:, :-1].float().log_softmax(-1)
    nll = -lp.gather(2, ids[:, 1:].unsqueeze(2)).mean()
    nll.backward()


step()
sync()
t0 = time.time()
for _ in range(3):
    step()
sync()
secs = (time.time() - t0) / 3
print(json.dumps({"what": "train_fwd_bwd", "impl": "transformers", "batch": a.train_batch, "len": a.train_len, "seconds": secs, "tokens_per_s": a.train_batch * a.train_len / secs}), flush=True)
