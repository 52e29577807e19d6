"""optim: what one optimizer step computes, as pure pieces the runtime calls.

    adam        Hyper (one step's frozen hyperparameters), chunk_update, its inverse chunk_undo and its
                correction chunk_rescale
    clip        the global-norm clip coefficient, torch.nn.utils.clip_grad_norm_'s arithmetic
    loss_scale  LossScaler: static or dynamic loss scaling with torch.amp.GradScaler's rules
    lr          LrSchedule: warm-up and decay (Hugging Face's formulas) or a user function of the step

Every per-step value is a function of the count of applied updates, frozen into a `Hyper` before the
step starts and handed to each chunk's update: nothing reads a shared mutable dict while the host Adam
of the last step may still be running.
"""
from .adam import Hyper, chunk_rescale, chunk_undo, chunk_update
from .clip import clip_coefficient
from .loss_scale import LossScaler
from .lr import LrSchedule

__all__ = ["Hyper", "chunk_update", "chunk_undo", "chunk_rescale", "clip_coefficient", "LossScaler", "LrSchedule"]
