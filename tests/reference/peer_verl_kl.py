"""verl 0.9.1's KL estimators (`verl.trainer.ppo.core_algos.kl_penalty`), value and gradient."""
from peers import leaf, out, peer, tensor


@peer("verl.kl_penalty")
def kl_penalty(logp, logp_ref, estimator):
    """Per-token `kl_penalty(logp, logp_ref, estimator)` and the gradient of its sum w.r.t. `logp`."""
    from verl.trainer.ppo.core_algos import kl_penalty as verl_kl

    lp = leaf(logp)
    k = verl_kl(lp, tensor(logp_ref), estimator)
    k.sum().backward()
    return out(value=k, grad=lp.grad)
