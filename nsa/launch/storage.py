"""Where a run's results live: ``runtime.storage_root`` and Ray's working-dir copy.

``ray job submit --working-dir .`` runs the driver (and every worker) inside a copy of the checkout that
Ray unpacks under ``<ray temp>/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>/`` and deletes
with the job's node (or its cache). A relative ``logging.root`` or ``data.path`` there would put the run
directory, the MLflow database and auto-built shards into that copy and lose them. The rule:

- ``runtime.storage_root`` set (``NSA_STORAGE_ROOT`` in the environment, which the cluster configs set on
  every node to the shared mount ``/mnt/shared``): relative ``logging.root``, ``data.path``,
  ``data.val_path``, ``train.resume_from`` and a relative ``sqlite:``/``file:`` ``logging.mlflow_uri``
  resolve against it (``runs`` -> ``/mnt/shared/runs``, ``data/fineweb_edu`` -> ``/mnt/shared/data/fineweb_edu``);
  absolute paths are kept. The root must be an existing directory (an unmounted share would otherwise
  fill the node's own disk).
- unset: relative paths resolve against the working directory, as for any program.
- either way, a path that would be *written* inside Ray's working-dir copy (``logging.root``, a missing
  ``data.path`` that the run would build or that the user would prepare there, a sqlite/file MLflow store)
  is refused before anything is written, with one line naming the fields and the fix. Reading inputs that
  were uploaded with the copy (an existing ``data.path``, a checkpoint) stays allowed.

``pipelines/prepare_data.py`` applies the same rule to ``--out`` (``--storage-root``, default
``$NSA_STORAGE_ROOT``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from nsa.data.sources import is_url
from nsa.launch.cli import UserError

# the folders Ray unpacks a job's working_dir into: <ray temp>/session_*/runtime_resources/working_dir_files/<pkg>
_COPY_PARTS = ("runtime_resources", "working_dir_files")
SHARED_MOUNT = "/mnt/shared"   # where ray_cluster.yaml and cluster/kuberay/*.yaml mount the shared storage


def working_dir_copy(path: str | os.PathLike) -> Optional[Path]:
    """The Ray working-dir copy (``.../runtime_resources/working_dir_files/<pkg>``) that contains ``path``,
    or None when ``path`` lies outside any."""
    parts = Path(os.path.abspath(os.path.expanduser(path))).parts
    for i in range(len(parts) - 2):
        if parts[i:i + 2] == _COPY_PARTS:
            return Path(*parts[:i + 3])
    return None


def job_copy(cwd: Optional[str | os.PathLike] = None, script: Optional[str] = None) -> Optional[Path]:
    """The working-dir copy this process runs in: its working directory or its entry script lies in one."""
    import sys
    for p in (Path.cwd() if cwd is None else Path(cwd), script if script is not None else sys.argv[0]):
        if p:
            copy = working_dir_copy(p)
            if copy is not None:
                return copy
    return None


def storage_root(value: Optional[str], field: str = "runtime.storage_root") -> Optional[Path]:
    """The checked ``runtime.storage_root`` (an existing directory), or None when unset. ``field``: the name
    the user gave it (``--storage-root`` for prepare_data.py)."""
    if not value:
        return None
    root = Path(value).expanduser()
    if not root.is_absolute():
        raise UserError(f"{field}={value} must be an absolute path (the shared mount, e.g. {field}={SHARED_MOUNT})")
    if not root.is_dir():
        raise UserError(f"{field}={value} is not a directory on this machine: mount the shared "
                        f"storage there (cluster/README.md, 'shared POSIX filesystem') or point it at an "
                        "existing directory")
    return root.resolve()


def place(value: str, root: Optional[Path], cwd: Optional[Path] = None) -> Path:
    """``value`` made absolute: against ``root`` when set and ``value`` is relative, else against ``cwd``."""
    p = Path(value).expanduser()
    if not p.is_absolute():
        p = (root if root is not None else (cwd or Path.cwd())) / p
    return p.resolve()


def refusal(bad: list[tuple[str, str, Path]], copy: Path) -> str:
    """One line: which fields land inside Ray's working-dir copy, and the two ways out."""
    what = "; ".join(f"{field}={value!r} -> {path}" for field, value, path in bad)
    names = " and ".join(field for field, _, _ in bad)
    return (f"{what}: inside Ray's working-dir copy of this job ({copy}), which is deleted with the job; set "
            f"runtime.storage_root={SHARED_MOUNT} (shared storage, or NSA_STORAGE_ROOT in the nodes' "
            f"environment) or give {names} an absolute path outside the copy")


def _uri_path(uri: str) -> Optional[str]:
    """The local path of a sqlite/file MLflow store URI, else None."""
    if uri.startswith("sqlite:///"):
        return uri[len("sqlite:///"):]
    if uri.startswith("file:"):
        rest = uri[len("file:"):]
        return rest[2:] if rest.startswith("//") else rest
    return None


def resolve_mlflow_uri(uri: Optional[str], root: Optional[Path], cwd: Optional[Path] = None) -> Optional[str]:
    """A sqlite/file store URI with an absolute path (the workers run elsewhere); other URIs unchanged."""
    path = _uri_path(uri) if uri else None
    if path is None or not path or Path(path).is_absolute():
        return uri
    scheme = "sqlite:///" if uri.startswith("sqlite:") else "file://"
    return scheme + str(place(path, root, cwd))


def apply_storage(cfg, *, cwd: Optional[str | os.PathLike] = None, script: Optional[str] = None) -> None:
    """Make the run's paths absolute by the rule above (in place), or raise UserError naming the fields that
    would be written inside Ray's working-dir copy. ``cwd``/``script``: this process's (tests pass others)."""
    here = Path.cwd() if cwd is None else Path(cwd)
    root = storage_root(cfg.runtime.storage_root)
    copy = job_copy(here, script)
    bad: list[tuple[str, str, Path]] = []

    def put(field: str, value: str, written: bool) -> str:
        p = place(value, root, here)
        if written and copy is not None and working_dir_copy(p) == copy:
            bad.append((field, value, p))
        return str(p)

    cfg.logging.root = put("logging.root", cfg.logging.root, True)
    if cfg.data.source == "parquet" and not is_url(cfg.data.path):   # hub / file:// URLs stay as given
        # a missing data dir is either built by this run (data.auto_prepare) or prepared there by the user
        missing = not place(cfg.data.path, root, here).exists()
        cfg.data.path = put("data.path", cfg.data.path, missing)
    if cfg.data.source == "parquet" and cfg.data.val_path and not is_url(cfg.data.val_path):
        cfg.data.val_path = put("data.val_path", cfg.data.val_path, False)
    if cfg.train.resume_from:
        cfg.train.resume_from = put("train.resume_from", cfg.train.resume_from, False)
    uri = cfg.logging.mlflow_uri
    if cfg.logging.mlflow and uri and _uri_path(uri) is not None:
        cfg.logging.mlflow_uri = resolve_mlflow_uri(uri, root, here)
        put("logging.mlflow_uri", _uri_path(cfg.logging.mlflow_uri) or "", True)
    if bad:
        raise UserError(refusal(bad, copy))


def prepare_out(out: str, storage: Optional[str], *, cwd: Optional[str | os.PathLike] = None,
                script: Optional[str] = None, root_field: str = "runtime.storage_root") -> Path:
    """``prepare_data.py --out`` by the same rule: relative to the storage root when one is given, and
    never inside Ray's working-dir copy, nor inside the ``nsa`` package (shipped to every Ray worker)."""
    import nsa
    here = Path.cwd() if cwd is None else Path(cwd)
    root = storage_root(storage, root_field)
    p = place(out, root, here)
    package = Path(nsa.__file__).resolve().parent
    if p == package or package in p.parents:
        raise UserError(f"--out={out!r} -> {p}: inside the nsa package ({package}), which a local Ray instance "
                        "ships to every worker with the code: choose a folder outside it (e.g. data/<name>)")
    copy = job_copy(here, script)
    if copy is not None and working_dir_copy(p) == copy:
        raise UserError(f"--out={out!r} -> {p}: inside Ray's working-dir copy of this job ({copy}), which is "
                        f"deleted with the job; pass --storage-root {SHARED_MOUNT} (or set NSA_STORAGE_ROOT in the "
                        "nodes' environment) or an absolute --out outside the copy")
    return p



def run_root(cfg) -> Path:
    """``logging.root`` as an absolute path by the rule above, for entry points that nest their own run
    directories under it before ``apply_storage`` runs (smoke, lanes); the launch still refuses a copy."""
    return place(cfg.logging.root, storage_root(cfg.runtime.storage_root))
