"""Upload a verified artifact folder to the Hugging Face Hub.

Dry run by default: it lists exactly the files that would be uploaded with their hashes. Nothing is
uploaded unless the folder verifies (hashes against provenance, and an offline fresh-process load).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .build import PROVENANCE, sha256_file
from .verify import verify


def publish(artifact: str | Path, repo: str, *, yes: bool = False) -> int:
    artifact = Path(artifact)
    problems, _ = verify(artifact)
    if problems:
        print(f"refusing to publish {artifact}: it does not verify", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    record = json.loads((artifact / PROVENANCE).read_text())
    files = {**record["files"], PROVENANCE: sha256_file(artifact / PROVENANCE)}
    action = "uploading" if yes else "dry run: would upload"
    print(f"{action} {len(files)} files from {artifact} to https://huggingface.co/{repo}")
    for name, digest in sorted(files.items()):
        print(f"  {digest}  {name}")
    if not record.get("official_weights"):
        print("note: provenance marks these weights as NOT the pinned official ones", file=sys.stderr)
    if not yes:
        print("pass --yes to upload")
        return 0
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=str(artifact), repo_id=repo, repo_type="model")
    print(f"uploaded to https://huggingface.co/{repo}")
    return 0
