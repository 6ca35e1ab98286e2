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


@peer("verl.compute_rewards")
def compute_rewards(token_scores, logp_old, logp_ref, coef):
    """`compute_rewards(token_level_scores, old_log_prob, ref_log_prob, kl_ratio)`: scores minus coef·k1."""
    from verl.trainer.ppo.core_algos import compute_rewards as verl_rewards

    return out(rewards=verl_rewards(tensor(token_scores), tensor(logp_old), tensor(logp_ref), coef))


def _apply_kl_penalty():
    """verl's `apply_kl_penalty`, compiled from its own source in `verl/trainer/ppo/ray_trainer.py`.

    The module itself cannot be imported here (it needs torchdata, ray's worker groups and the rest of
    the trainer), so the function's definition is taken from the file as it is and run with the names
    it uses: `core_algos` and `masked_mean`, verl's own.
    """
    import ast
    import os

    import verl
    from verl.trainer.ppo import core_algos
    from verl.utils.torch_functional import masked_mean

    path = os.path.join(os.path.dirname(verl.__file__), "trainer", "ppo", "ray_trainer.py")
    tree = ast.parse(open(path).read())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "apply_kl_penalty"]
    fn.decorator_list = []
    for a in fn.args.args:  # annotations name types the stand-in namespace does not hold
        a.annotation = None
    fn.returns = None
    ns = {"core_algos": core_algos, "masked_mean": masked_mean, "torch": __import__("torch")}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), ns)
    return ns["apply_kl_penalty"]


class _Batch(dict):
    """What `apply_kl_penalty` reads of a `DataProto`'s batch: items and `batch_size`."""

    @property
    def batch_size(self):
        return [self["response_mask"].shape[0]]


@peer("verl.apply_kl_penalty")
def apply_kl_penalty(token_scores, logp_old, logp_ref, mask, estimator, init_coef, target, horizon):
    """`apply_kl_penalty(data, kl_ctrl, kl_penalty)` with an `AdaptiveKLController` (or a `FixedKLController`
    when `target` is None): the penalised rewards, the measured KL, the coefficient used, and the
    controller's value after its update."""
    from verl.trainer.ppo.core_algos import AdaptiveKLController, FixedKLController

    ctrl = FixedKLController(init_coef) if target is None else AdaptiveKLController(init_coef, target, horizon)
    data = type("Data", (), {})()
    data.batch = _Batch(
        response_mask=tensor(mask),
        token_level_scores=tensor(token_scores),
        old_log_probs=tensor(logp_old),
        ref_log_prob=tensor(logp_ref),
    )
    data, metrics = _apply_kl_penalty()(data, ctrl, kl_penalty=estimator)
    return out(
        rewards=data.batch["token_level_rewards"],
        kl_mean=metrics["actor/reward_kl_penalty"],
        coef=metrics["actor/reward_kl_penalty_coeff"],
        coef_after=float(ctrl.value),
    )


@peer("verl.kl_controller")
def kl_controller(init_coef, target, horizon, updates):
    """`AdaptiveKLController` (or `FixedKLController` when `target` is None) after each of `updates`,
    a list of `[current_kl, n_steps]`."""
    from verl.trainer.ppo.core_algos import AdaptiveKLController, FixedKLController

    ctrl = FixedKLController(init_coef) if target is None else AdaptiveKLController(init_coef, target, horizon)
    values = []
    for kl, n in updates:
        ctrl.update(current_kl=kl, n_steps=int(n))
        values.append(float(ctrl.value))
    return out(values=values)
