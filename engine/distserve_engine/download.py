"""Download a checkpoint from the Hugging Face Hub into a folder the engine reads.

    python -m distserve_engine.download --repo facebook/opt-13b --revision main \
        --dir /models/hf/facebook--opt-13b/main [--allow '*.json' --allow '*.safetensors' ...]

The init container of an engine pod runs this before the engine starts (token from
HF_TOKEN). The folder is plain files (`local_dir`), so its path is known before the
download. A finished download leaves a marker naming the repository and revision: a
restarted pod, or the next pod on a shared volume, skips the work (unless it wants
files the marker's download did not take). A repository with
only PyTorch `.bin` weights has them converted to safetensors, the one format the
engine reads. Progress goes to the log.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("distserve_engine.download")
MARKER = ".distserve-download.json"
WEIGHT_PATTERN = "*.safetensors"
BIN_PATTERN = "*.bin"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m distserve_engine.download",
                                description="Download a Hugging Face checkpoint.")
    p.add_argument("--repo", required=True, help="repository id, e.g. facebook/opt-13b")
    p.add_argument("--revision", default="main", help="branch, tag or commit")
    p.add_argument("--dir", required=True, help="folder to fill")
    p.add_argument("--allow", action="append", default=[], help="glob of files to take")
    return p.parse_args(argv)


def is_done(folder: Path, repo: str, revision: str, allow: list[str]) -> bool:
    """Whether this folder holds a finished download of this repository and revision
    that took at least these files (a router's download takes no weights)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    taken = marker.get("allow")
    is_superset = taken == [] or (bool(allow) and set(allow) <= set(taken or []))
    return marker.get("repo") == repo and marker.get("revision") == revision and is_superset


def patterns_for(repo_files: list[str], allow: list[str]) -> list[str]:
    """The allow patterns, with `*.bin` added when the weights exist only as .bin files."""
    if WEIGHT_PATTERN not in allow:
        return allow
    if any(fnmatch.fnmatch(f, WEIGHT_PATTERN) for f in repo_files):
        return allow
    if any(fnmatch.fnmatch(f, BIN_PATTERN) for f in repo_files):
        return [*allow, BIN_PATTERN]
    return allow


def convert_bins(folder: Path) -> int:
    """Rewrite each `*.bin` state dict as `*.safetensors` and delete it; the count."""
    import torch
    from safetensors.torch import save_file

    count = 0
    for path in sorted(folder.glob(BIN_PATTERN)):
        state = torch.load(path, map_location="cpu", weights_only=True)
        tensors = {k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
        save_file(tensors, str(path.with_suffix(".safetensors")), metadata={"format": "pt"})
        path.unlink()
        count += 1
        log.info("converted %s to safetensors (%d tensors)", path.name, len(tensors))
    return count


def download(repo: str, revision: str, folder: Path, allow: list[str]) -> Path:
    """Fill `folder` with the repository's files that match `allow` (all when empty)."""
    from huggingface_hub import HfApi, snapshot_download

    if is_done(folder, repo, revision, allow):
        log.info("%s@%s already in %s", repo, revision, folder)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    repo_files = HfApi().list_repo_files(repo, revision=revision)
    patterns = patterns_for(repo_files, allow) if allow else None
    log.info("downloading %s@%s to %s (%s)", repo, revision, folder,
             ", ".join(patterns) if patterns else "all files")
    snapshot_download(repo, revision=revision, local_dir=folder, allow_patterns=patterns)
    if convert_bins(folder):
        log.info("weights converted to safetensors")
    marker = {"repo": repo, "revision": revision, "allow": sorted(allow)}  # []: every file
    (folder / MARKER).write_text(json.dumps(marker))
    log.info("%s@%s ready in %s", repo, revision, folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    """Download, or exit 1 with the reason on stderr (the pod's init container fails)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        download(args.repo, args.revision, Path(args.dir), args.allow)
    except Exception as exc:  # noqa: BLE001 - any failure ends the init container
        print(f"error: cannot download {args.repo}@{args.revision}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
