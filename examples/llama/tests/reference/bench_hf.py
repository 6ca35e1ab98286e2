"""transformers' side of scripts/bench_llama.sh: the same measurements as `llama bench`.

usage: python examples/llama/tests/reference/bench_hf.py MODEL_DIR NEW_TOKENS TRAIN_BATCH TRAIN_LEN
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

d, new_tokens, train_batch, train_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(d)
text = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story about a dragon."}], add_generation_prompt=True, tokenize=False)
prompt = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
for batch in (1, 16):
    x = prompt.repeat(batch, 1)
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        model.generate(x, max_new_tokens=4, **kw)
        t0 = time.time()
        g = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        secs = time.time() - t0
    n = (g.shape[1] - x.shape[1]) * batch
    print(json.dumps({"what": "generate", "impl": "transformers", "batch": batch, "new_tokens": new_tokens, "seconds": secs, "tokens_per_s": n / secs}))
model.train()
torch.manual_seed(0)
ids = torch.randint(model.config.vocab_size, (train_batch, train_len))


def step():
    logits = model(input_ids=ids).logits
    lp = logits[:, :-1].float().log_softmax(-1)
    nll = -lp.gather(2, ids[:, 1:].unsqueeze(2)).mean()
    nll.backward()


step()
t0 = time.time()
for _ in range(3):
    step()
secs = (time.time() - t0) / 3
print(json.dumps({"what": "train_fwd_bwd", "impl": "transformers", "batch": train_batch, "len": train_len, "seconds": secs, "tokens_per_s": train_batch * train_len / secs}))
