"""model.attention=dense through the training loop (no Ray: nsa.train.local_env.LocalEnv), generate.py on its
checkpoint, and the clear refusals of loading it as NSA (generate.py --attention nsa, train.resume_from)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import PIPELINES, REPO, TINY_PROFILE, tiny_overrides
from nsa.config import resolve_config
from nsa.train.local_env import LocalEnv
from nsa.train.loop import run_training

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def dense_run(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("dense_runs")
    over = tiny_overrides(tiny_data, root, model__attention="dense", model__n_layers=1, model__dim=64,
                          train__steps=30, train__save_every=0, train__eval_every=0, logging__name="d",
                          logging__log_every=5)
    cfg, _ = resolve_config(TINY_PROFILE, over, env={})
    torch.set_num_threads(2)
    run_dir = os.path.join(cfg.logging.root, cfg.logging.name)
    return run_training(cfg, run_dir, LocalEnv(cfg, run_dir)), run_dir, tiny_data, root


def test_dense_trains_and_its_loss_falls(dense_run):
    s, run_dir, _, _ = dense_run
    assert s["status"] == "completed" and s["step"] == 30 and s["checkpoints"] == [30]
    # held-out loss after 30 steps against the first step's (single steps' losses are noisy on this data)
    assert s["final_val_loss"] < 0.75 * s["first_logged_loss"], s
    env = json.loads(open(os.path.join(run_dir, "env.json")).read())
    assert "dense=sdpa" in env["kernel_policy"]           # the dense choice is logged with its reason


def _generate(*args):
    return subprocess.run([sys.executable, str(PIPELINES / "generate.py"), *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)


def test_generate_on_the_dense_checkpoint_and_refuse_it_as_nsa(dense_run):
    _, run_dir, _, _ = dense_run
    r = _generate("--checkpoint", run_dir, "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "generated 6 tokens" in r.stdout and "step 30" in r.stdout
    r = _generate("--checkpoint", run_dir, "--attention", "nsa")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "model.attention='dense'" in line and "model.attention='nsa'" in line, r.stderr


def test_resume_a_dense_checkpoint_as_nsa_is_refused_before_ray(dense_run):
    from nsa.launch import builder
    from nsa.launch.cli import UserError
    _, run_dir, data, root = dense_run
    cfg, _ = resolve_config(TINY_PROFILE, tiny_overrides(data, root, train__resume_from=run_dir), env={})
    with pytest.raises(UserError, match="model.attention: checkpoint 'dense', config 'nsa'"):
        builder.validate_inputs(cfg)


def test_checkpoints_from_before_the_field_resume_as_nsa():
    """A checkpoint config without model.attention (written before the field existed) is an NSA one."""
    from nsa.launch import builder
    from nsa.launch.cli import UserError
    from nsa.config import RunConfig
    cfg = RunConfig()
    old = cfg.to_dict()
    del old["model"]["attention"]
    builder._check_model_compat(cfg, old, "old checkpoint")          # no error: same model
    cfg.model.attention = "dense"
    with pytest.raises(UserError, match="model.attention: checkpoint 'nsa', config 'dense'"):
        builder._check_model_compat(cfg, old, "old checkpoint")
