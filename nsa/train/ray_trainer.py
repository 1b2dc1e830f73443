"""The project's TorchTrainer: Ray's default failure policy, except that user errors end the run at once.

Kept apart from nsa/train/failures.py because subclassing needs Ray at import time, while the worker-side
error wrapping (NotRetried) is imported by the plain training loop, which also runs where Ray is absent
(a bare GPU image running the benchmarks and GPU tests).
"""
from __future__ import annotations

from typing import Any

from nsa.train.failures import not_retried_failures


def _policy_base() -> type:
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
    return DefaultFailurePolicy


class NoRetryForUserErrors(_policy_base()):   # type: ignore[misc]
    """Ray's default policy, except that a worker group failing with NotRetried is raised at once."""

    def make_decision(self, training_failed_error: Any) -> Any:
        from ray.train.v2._internal.execution.failure_handling import FailureDecision
        if not_retried_failures(training_failed_error):
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


def _trainer_base() -> type:
    from ray.train.torch import TorchTrainer
    return TorchTrainer


class NsaTorchTrainer(_trainer_base()):   # type: ignore[misc]
    """TorchTrainer whose controller runs NoRetryForUserErrors. Ray 2.60 builds the policy in the driver
    and hands it to the controller actor here; tests/test_failures.py fails if that hook moves."""

    def _initialize_and_run_controller(self, **kw: Any) -> Any:
        kw["failure_policy"] = NoRetryForUserErrors(self.run_config.failure_config)
        return super()._initialize_and_run_controller(**kw)
