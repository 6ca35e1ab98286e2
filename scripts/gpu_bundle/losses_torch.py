"""The losses of `llama check losses` written directly in PyTorch, timed the same way.

The reference side of the GPU check's loss timings: the same inputs (shapes, masks, rewards),
the same gradient, written as verl and TRL write these losses (no input checks), forward +
backward, 2 warm-up calls, then the mean of --iters calls between two synchronisations.
Prints one JSON line per loss, like `llama check losses`. Values are not compared here: the
crate's tests compare them with the peers' implementations.

    python3 losses_torch.py --device cuda --batch 512 --len 2048 --iters 20
"""
import argparse
import json
import time

import torch


def topr_token(logp, logp_mu, rewards, mask):
    # The paper's TOPR (canonical limits, sequence ratio, each sequence's loss over its length):
    # positives weight 1, negatives the ratio truncated at 1, computed in log space.
    m = mask.float()
    lengths = m.sum(1).clamp(min=1)
    log_ratio = ((logp.detach() - logp_mu) * m).sum(1)
    weight = torch.where(rewards >= 0, torch.ones_like(log_ratio), torch.exp(log_ratio.clamp(max=0.0)))
    seq_logp = (logp * m).sum(1) / lengths
    return -(rewards * weight * seq_logp).mean()


def ppo_clip(logp, logp_mu, advantages, mask, eps=0.2):
    m = mask.float()
    ratio = torch.exp((logp - logp_mu).clamp(-20.0, 20.0))
    adv = advantages[:, None]
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    return (loss * m).sum() / m.sum().clamp(min=1)


def dpo(logp, logp_mu, mask, beta=0.1):
    m = mask.float()
    seq, seq_mu = (logp * m).sum(1), (logp_mu * m).sum(1)
    half = seq.shape[0] // 2
    logits = beta * ((seq[:half] - seq_mu[:half]) - (seq[half:] - seq_mu[half:]))
    return -torch.nn.functional.logsigmoid(logits).mean()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    logp = (-torch.rand(a.batch, a.len, device=dev) * 2).requires_grad_(True)
    logp_mu = logp.detach() + torch.randn(a.batch, a.len, device=dev) * 0.1
    lengths = torch.randint(a.len // 2, a.len + 1, (a.batch, 1), device=dev)
    mask = torch.arange(a.len, device=dev)[None, :] < lengths
    rewards = torch.randint(0, 2, (a.batch,), device=dev).float() * 2 - 1
    calls = {
        "topr_token_loss": lambda: topr_token(logp, logp_mu, rewards, mask),
        "ppo_clip_loss": lambda: ppo_clip(logp, logp_mu, rewards, mask),
        "dpo_loss": lambda: dpo(logp, logp_mu, mask),
    }
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for name, call in calls.items():
        for _ in range(2):
            call().backward()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            call().backward()
        sync()
        ms = (time.perf_counter() - t0) * 1e3 / a.iters
        print(json.dumps({"what": "loss", "device": str(dev), "loss": name, "checks": "pytorch",
                          "batch": a.batch, "len": a.len, "ms": ms}), flush=True)


if __name__ == "__main__":
    main()
