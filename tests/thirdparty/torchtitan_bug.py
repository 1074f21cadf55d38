"""torchtitan's trainer with one injected bug, for tests/thirdparty/test_torchtitan.py: on tensor-parallel
rank 1, layer 1's feed-forward multiplies its hidden activation by 1.25 before w2 (a wrong scale, as a
normalization by the local instead of the global width would be). Nothing in site-packages changes:
torchtitan's FeedForward.forward is replaced in this process only, then the ttrace launcher runs
torchtitan's own main() with the arguments given.

    torchrun --nproc-per-node 2 tests/thirdparty/torchtitan_bug.py --module ttrace_examples.torchtitan ...
"""

import torch.nn.functional as F

from ttrace_examples.torchtitan import launcher

BUGGY_LAYER, BUGGY_TP_RANK, WRONG_SCALE = "1", 1, 1.25


def inject_bug() -> None:
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.trainer import Trainer

    def forward(self, x):
        hidden = F.silu(self.w1(x)) * self.w3(x)
        if getattr(self, "_wrong_scale", None):
            hidden = hidden * self._wrong_scale
        return self.w2(hidden)

    built = Trainer.__init__

    def __init__(self, *args, **kwargs):
        built(self, *args, **kwargs)
        parallel_dims = self.parallel_dims
        if parallel_dims.tp_enabled and parallel_dims.get_mesh("tp").get_local_rank() == BUGGY_TP_RANK:
            layer = self.model_parts[0].layers[BUGGY_LAYER]
            getattr(layer, "_checkpoint_wrapped_module", layer).feed_forward._wrong_scale = WRONG_SCALE

    FeedForward.forward = forward
    Trainer.__init__ = __init__


if __name__ == "__main__":
    launcher.use_cpu_without_accelerator()
    inject_bug()
    launcher.main()
