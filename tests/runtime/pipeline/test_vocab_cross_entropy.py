"""``vocab_parallel_cross_entropy`` on one rank (the whole vocabulary as its shard): its losses
equal ``F.cross_entropy`` and the gradient of its surrogate term is the cross entropy's; targets
outside the shard contribute no target logit (the pp2/pp4 gloo runs cover the all-reduce)."""

import torch
import torch.nn.functional as F

from megatron_slim.runtime.pipeline.vocab import vocab_parallel_cross_entropy


def test_one_shard_matches_torch_cross_entropy():
    torch.manual_seed(0)
    logits = (4 * torch.randn(5, 3, 11)).requires_grad_()
    targets = torch.randint(0, 11, (5, 3))
    losses, surrogate = vocab_parallel_cross_entropy(logits, targets, None)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(5, 3)
    torch.testing.assert_close(losses, want.detach())
    weights = torch.rand(5, 3)
    (grad,) = torch.autograd.grad((surrogate * weights).sum(), logits)
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    torch.testing.assert_close(grad, want_grad)


def test_a_target_outside_the_shard_adds_no_target_logit():
    logits = torch.tensor([[[1.0, 2.0, 3.0]]])
    inside, _ = vocab_parallel_cross_entropy(logits, torch.tensor([[2]]), None)
    outside, _ = vocab_parallel_cross_entropy(logits, torch.tensor([[5]]), None)
    assert torch.allclose(outside - inside, torch.tensor([[3.0]]))  # the missing target logit
