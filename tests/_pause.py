"""A step of backward that sleeps (0.1 s unless told): room for the peers to catch up between
gradient hooks, or a rank made late on purpose."""
import time

import torch


class Pause(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds=0.1):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None
