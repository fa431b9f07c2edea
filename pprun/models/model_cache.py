"""pprun's cache directory, and the file lock and permissions its converters share.

Below every converter (the demo model's GGUF, Whisper's CTranslate2), so each imports it and
none imports another.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """Root of pprun's cache: ``$PPRUN_CACHE_DIR`` if set, else ``~/.cache/pprun``."""
    env = os.environ.get("PPRUN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pprun"


def apply_umask_permissions(directory: Path) -> None:
    """Give ``directory`` and its files the permissions an ordinary mkdir/open would have given
    (``mkdtemp`` and safetensors create owner-only entries; a shared cache should not)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing) for the block."""
    # flock locks belong to the open file description, so this excludes both
    # other processes and other threads that open the file themselves.
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)
