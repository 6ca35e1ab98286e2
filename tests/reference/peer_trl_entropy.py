"""TRL 1.16.0's top-entropy token mask (`top_entropy_quantile`, Wang et al. arXiv 2506.01939),
restated as a function.

Follows `trl/trainer/grpo_trainer.py` of TRL 1.16.0: `GRPOTrainer.get_high_entropy_mask`, lines
1380-1416 (on one process: the unmasked entropies cast to float32, their `torch.quantile` at
`threshold`, then `entropies * mask >= threshold` and the mask), called at line 3050 with
`threshold = 1 - top_entropy_quantile`.
"""
import torch

from peers import out, peer, tensor


@peer("trl.top_entropy_mask")
def top_entropy_mask(entropy, mask, rho):
    entropies = tensor(entropy)
    m = tensor(mask)
    local = entropies[m.bool()].float()
    if local.numel() == 0:
        return out(value=torch.zeros_like(entropies, dtype=torch.bool).double())
    threshold = torch.quantile(local, 1 - rho)
    keep = (entropies * m.float()) >= threshold
    return out(value=(keep & m.bool()).double())
