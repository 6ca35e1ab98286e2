"""VAPO's positive-example NLL (arXiv 2504.05118, section 3.3) as cosmos-rl adds it to its GRPO loss,
restated as a plain function (cosmos-rl is not installed). No verl, TRL or NeMo-RL release has it.

Follows cosmos-rl's GRPO trainer (`cosmos_rl/policy/trainer/.../grpo_trainer.py`, option
`train_policy.positive_nll_coef`): a completion is positive when its reward is > 0; per micro-batch,
when the coefficient is > 0 and some token is positive, `loss += coef * -logp[positive & mask].mean()`,
the mean over the micro-batch's positive tokens only; with no positive token the term is skipped.
`vapo` is the paper's formula on one batch, `-(1/sum_{i in T} |o_i|) sum_{i in T} sum_t log pi`.
"""
import torch

from peers import leaf, out, peer, tensor


@peer("cosmos.positive_nll")
def positive_nll(logp, mask, rewards, coef):
    lp = leaf(logp)
    m = tensor(mask).bool()
    positive = (tensor(rewards) > 0)[:, None].expand_as(m)
    kept = positive & m
    loss = (lp * 0.0).sum()  # the term skipped: nothing added
    if kept.any():
        loss = loss + coef * -lp[kept].mean()
    loss.backward()
    return out(value=loss, grad=lp.grad)


@peer("vapo.nll")
def vapo_nll(logp, mask, positive):
    """The paper's L_NLL: the sum over the positive completions' tokens over their number."""
    lp = leaf(logp)
    kept = tensor(mask).bool() & torch.tensor(positive, dtype=torch.bool)[:, None]
    total = kept.sum()  # the positive completions' token count
    loss = -(lp * kept).sum() / total if total > 0 else (lp * 0.0).sum()
    loss.backward()
    return out(value=loss, grad=lp.grad)
