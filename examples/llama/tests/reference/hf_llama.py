"""Reference computations with Hugging Face transformers, for the Llama example's parity tests.

Used only by tests (never by the library). Every command prints one JSON object on stdout.

  make     --out DIR [--layers N --hidden H --heads A --kv-heads K --intermediate I
            --tie --rope default|llama3 --dtype float32|bfloat16 --seed S]
           writes a randomly initialised LlamaForCausalLM with save_pretrained, plus a small
           byte-level tokenizer with a chat template
  run      --model DIR --requests FILE
           FILE holds a JSON list of requests, each {"op": "logits", "ids": [[...]], "mask": [[...]]}
           or {"op": "greedy", "ids": [...], "max_new_tokens": N} or
           {"op": "chat_ids", "prompt": TEXT}; prints {"results": [...]} in the same order
"""
import argparse
import json
import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bos = vocab["<s>"]
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast, len(vocab), bos, vocab["</s>"]


def make(a):
    torch.manual_seed(a.seed)
    tok, vocab, bos, eos = byte_tokenizer()
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if a.rope == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=a.tie, bos_token_id=bos, eos_token_id=eos, rope_parameters=rope,
    )
    model = LlamaForCausalLM(cfg)
    # Larger weights than the default init, so that logits are far from uniform.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 / p.shape[1] ** 0.5 * 4)
            else:
                p.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, a.dtype))
    if a.shard:
        model.save_pretrained(a.out, safe_serialization=True, max_shard_size="40KB")
    else:
        model.save_pretrained(a.out, safe_serialization=True)
    tok.save_pretrained(a.out)
    print(json.dumps({"vocab_size": vocab, "bos": bos, "eos": eos}))


def run(a):
    model = LlamaForCausalLM.from_pretrained(a.model, attn_implementation="eager").eval()
    reqs = json.load(open(a.requests))
    out = []
    for r in reqs:
        if r["op"] == "logits":
            ids = torch.tensor(r["ids"])
            mask = torch.tensor(r.get("mask", [[1] * len(x) for x in r["ids"]]))
            pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
            out.append(logits.tolist())
        elif r["op"] == "greedy":
            ids = torch.tensor([r["ids"]])
            with torch.no_grad():
                g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r["max_new_tokens"],
                                   do_sample=False, pad_token_id=model.config.eos_token_id)
            out.append(g[0, ids.shape[1]:].tolist())
        elif r["op"] == "chat_ids":
            tok = AutoTokenizer.from_pretrained(a.model)
            text = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out.append({"text": text, "ids": ids})
        else:
            raise SystemExit(f"unknown op {r['op']}")
    print(json.dumps({"results": out}))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--hidden", type=int, default=64)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--intermediate", type=int, default=96)
    m.add_argument("--tie", action="store_true")
    m.add_argument("--rope", default="default")
    m.add_argument("--dtype", default="float32")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shard", action="store_true", help="write a sharded checkpoint with an index")
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--requests", required=True)
    a = p.parse_args()
    {"make": make, "run": run}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
