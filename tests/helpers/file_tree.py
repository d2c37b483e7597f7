"""A directory's whole contents as a value, to prove a run left it byte for byte as it was."""
import os
from pathlib import Path


def file_tree(root: Path) -> dict:
    """Every entry under `root`, links not followed: a file's bytes, a link's target, a directory."""
    entries = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            entries[str(path.relative_to(root))] = (f"link to {os.readlink(path)}" if path.is_symlink() else
                                                    path.read_bytes() if path.is_file() else "directory")
    return entries
