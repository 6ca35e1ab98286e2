"""verl 0.9.1's loss aggregation (`verl.trainer.ppo.core_algos.agg_loss`), one process."""
from peers import out, peer, tensor


@peer("verl.agg_loss")
def agg_loss(loss, mask, mode, loss_scale_factor=None):
    """`agg_loss(loss, mask, mode, loss_scale_factor=...)` with the call's own counts."""
    from verl.trainer.ppo.core_algos import agg_loss as verl_agg

    return out(value=verl_agg(tensor(loss), tensor(mask), mode, loss_scale_factor=loss_scale_factor))
