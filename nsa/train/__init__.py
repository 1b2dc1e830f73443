"""Training: one step (accumulate/clip/scale/skip), precision, schedule, checkpoints, the worker loop.

Importing this package does not import Ray; ``nsa.train.ray_loop`` (imported by the trainer builder) does.
"""
from nsa.train.checkpoint import (CheckpointError, build_state, list_checkpoints, load_checkpoint,
                                  load_model_weights, restore_training_state, save_checkpoint,
                                  verify_checkpoint)
from nsa.train.precision import Precision, precision_from_config, setup_precision
from nsa.train.schedule import build_optimizer, build_scheduler, lr_factor, param_groups
from nsa.train.step import StepResult, eval_loss, forward_backward, lm_loss, train_step

__all__ = ["CheckpointError", "build_state", "list_checkpoints", "load_checkpoint", "load_model_weights",
           "restore_training_state", "save_checkpoint", "verify_checkpoint", "Precision",
           "precision_from_config", "setup_precision", "build_optimizer", "build_scheduler", "lr_factor",
           "param_groups", "StepResult", "eval_loss", "forward_backward", "lm_loss", "train_step"]
