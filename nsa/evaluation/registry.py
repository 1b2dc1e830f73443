"""A trained run as an MLflow model: logged (pyfunc), registered, and promoted to an alias on its evaluation.

The logged model holds the weights only (no optimizer state: a third of a training checkpoint), the run's
config, the evaluation JSON and the tokenizer's description; ``mlflow.pyfunc.load_model(uri).predict(
["def main("], params={"max_new_tokens": 32})`` continues prompts greedily. Loading needs this
repository's ``nsa`` package installed (``pip install -e .``); the model version's tags name the commit.

Promotion compares the candidate's ``val_bpb`` (bits per byte on the val split at the evaluation's first
length, lower is better) with the alias holder's, recorded as version tags at registration. Only
evaluations of the same held-out bytes (val fingerprint), length and token budget compare; anything else
is refused with the reason, as is a candidate that does not beat the holder.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import mlflow
import torch

TAG_KEYS = ("val_bpb", "eval_length", "val_fingerprint", "eval_max_tokens")


class NSAPyfuncModel(mlflow.pyfunc.PythonModel):
    """TinyLM behind MLflow's pyfunc interface: a list of prompts (or a one-column DataFrame) -> the
    greedy continuation of each (``params={"max_new_tokens": n}``, default 32)."""

    def load_context(self, context: Any) -> None:
        from nsa.data.tokenizers import get_tokenizer
        from nsa.evaluation.core import build_model
        blob = torch.load(context.artifacts["weights"], map_location="cpu", weights_only=True)
        self.model = build_model(blob["config"], blob["model"])
        data = blob["config"].get("data", {})
        self.tok = get_tokenizer(data.get("tokenizer", "byte"), tiktoken_path=data.get("tiktoken_path"))

    def predict(self, context, model_input, params=None):   # untyped: MLflow reads hints as a schema
        if hasattr(model_input, "iloc"):              # a DataFrame: its first column holds the prompts
            prompts = [str(v) for v in model_input.iloc[:, 0].tolist()]
        elif isinstance(model_input, str):
            prompts = [model_input]
        else:
            prompts = [str(v) for v in model_input]
        n = int((params or {}).get("max_new_tokens", 32))
        out = []
        for p in prompts:
            ids = torch.tensor([self.tok.encode(p) or [self.tok.eos_id]])
            new = self.model.generate(ids, n, cuda_graph=False)[0, ids.shape[1]:].tolist()
            out.append(self.tok.decode(new))
        return out


def git_commit() -> str:
    """The repository's HEAD (with -dirty), so a registered version says which nsa code reads it."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("-dirty" if dirty else "")) if sha else "unknown"


def version_tags(results: Mapping[str, Any], run_dir: Path) -> dict[str, str]:
    """What a model version records of its evaluation: enough to decide a promotion without files."""
    pk = (results.get("passkey") or {}).get("accuracy_by_length") or {}
    tags = {"val_bpb": repr(float(results["val_bpb"])), "eval_length": str(results["default_length"]),
            "val_fingerprint": str(results["val"]["fingerprint"]),
            "eval_max_tokens": str(results["val"]["max_tokens"]), "checkpoint_step": str(results["step"]),
            "checkpoint": str(results["checkpoint"]), "run_dir": str(run_dir),
            "attention": str(results["attention"]), "tokenizer": str(results["tokenizer"]),
            "nsa_commit": git_commit()}
    if pk:
        tags["passkey_acc"] = repr(sum(pk.values()) / len(pk))
        tags["passkey_max_length"] = str(max(int(n) for n in pk))
    return tags


def registered_version(client: Any, name: str, tags: Mapping[str, str]) -> Optional[Any]:
    """An existing version of ``name`` for the same checkpoint and evaluation (re-running promote.py
    registers nothing twice)."""
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except Exception:
        return None
    for v in versions:
        t = v.tags or {}
        if all(t.get(k) == tags[k] for k in ("checkpoint", "checkpoint_step", "val_bpb", "val_fingerprint")):
            return v
    return None


def log_and_register(*, uri: str, run_id: str, name: str, checkpoint_file: Path, results: Mapping[str, Any],
                     eval_json: Path, run_dir: Path) -> tuple[Any, bool]:
    """Log the checkpoint as a pyfunc model in MLflow run ``run_id`` and register it as a version of
    ``name``; (version, created). The run's status is restored afterwards (logging reopens it)."""
    from mlflow import MlflowClient
    from mlflow.models import infer_signature
    from nsa.train.checkpoint import load_checkpoint
    client = MlflowClient(uri)
    tags = version_tags(results, run_dir)
    found = registered_version(client, name, tags)
    if found is not None:
        return found, False
    state = load_checkpoint(checkpoint_file, map_location="cpu")
    config = state["config"]
    data = config.get("data", {})
    from nsa.data.tokenizers import get_tokenizer
    tok = get_tokenizer(data.get("tokenizer", "byte"), tiktoken_path=data.get("tiktoken_path"))
    status = client.get_run(run_id).info.status
    mlflow.set_tracking_uri(uri)
    with tempfile.TemporaryDirectory(prefix="nsa-model-") as tmp:
        t = Path(tmp)
        torch.save({"model": state["model"], "config": config, "step": int(state["step"])}, t / "weights.pt")
        del state
        (t / "config.json").write_text(json.dumps(config, indent=2))
        (t / "tokenizer.json").write_text(json.dumps({"name": tok.name, "vocab_size": tok.vocab_size,
                                                       "eos_id": tok.eos_id, "tiktoken_path": data.get("tiktoken_path")}))
        artifacts = {"weights": str(t / "weights.pt"), "config": str(t / "config.json"),
                     "tokenizer": str(t / "tokenizer.json"), "eval": str(eval_json)}
        sig = infer_signature(["def main("], ["  pass"], params={"max_new_tokens": 32})
        reqs = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "numpy"]
        try:
            with mlflow.start_run(run_id=run_id):
                info = mlflow.pyfunc.log_model(
                    name="model", python_model=NSAPyfuncModel(), artifacts=artifacts, signature=sig,
                    pip_requirements=reqs, metadata={"val_bpb": float(results["val_bpb"]),
                                                     "eval_length": int(results["default_length"]),
                                                     "checkpoint_step": int(results["step"])})
        finally:   # start_run reopened the run and end_run closed it FINISHED: give it back its status
            client.update_run(run_id, status=status)
    version = mlflow.register_model(info.model_uri, name, tags=tags)
    client.update_model_version(name, version.version,
                                description=f"{tags['attention']} TinyLM, {run_dir.name} step {tags['checkpoint_step']}: "
                                            f"val bits/byte {float(tags['val_bpb']):.4f} at {tags['eval_length']} tokens")
    return client.get_model_version(name, version.version), True


@dataclass
class Decision:
    promote: bool
    reason: str


def decide(candidate: Any, holder: Optional[Any], alias: str) -> Decision:
    """Whether ``candidate`` (a model version) should take ``alias`` from ``holder``, and why (lower
    val_bpb wins; only evaluations of the same val bytes, length and token budget compare)."""
    c = candidate.tags or {}
    if holder is None:
        return Decision(True, f"no version holds @{alias} yet")
    if str(holder.version) == str(candidate.version):
        return Decision(False, f"version {candidate.version} already holds @{alias}")
    h = holder.tags or {}
    if "val_bpb" not in h:
        return Decision(False, f"@{alias} is held by version {holder.version}, which has no val_bpb tag (not "
                               "registered by promote.py): nothing to compare; move the alias by hand if intended")
    for key, what in (("val_fingerprint", "val split"), ("eval_length", "length"),
                      ("eval_max_tokens", "token budget (--max-tokens)")):
        if c.get(key) != h.get(key):
            return Decision(False, f"not comparable with @{alias} (version {holder.version}): evaluated on another "
                                   f"{what} ({c.get(key)} vs {h.get(key)}); evaluate both with the same data, "
                                   "--lengths and --max-tokens")
    cb, hb = float(c["val_bpb"]), float(h["val_bpb"])
    at = f"at {c['eval_length']} tokens"
    if cb < hb:
        return Decision(True, f"val bits/byte {cb:.4f} beats version {holder.version}'s {hb:.4f} {at}")
    return Decision(False, f"val bits/byte {cb:.4f} does not beat @{alias} (version {holder.version}: {hb:.4f}) {at}; "
                           "lower is better")


def alias_holder(client: Any, name: str, alias: str) -> Optional[Any]:
    try:
        return client.get_model_version_by_alias(name, alias)
    except Exception:    # RESOURCE_DOES_NOT_EXIST: nobody holds it
        return None
