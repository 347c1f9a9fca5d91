"""Local or object store: what a lake URI names, without importing pyarrow or deltalake (the
CLI prints resume commands before a run imports the lake: infra/paths.place_options)."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse


def is_local(uri: str) -> bool:
    """True for a plain path or ``file://`` URI (no object store)."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def local_path(uri: str) -> str:
    """The filesystem path of a local table URI (``file:///a%20b/t/`` -> ``/a b/t/``)."""
    return unquote(urlparse(uri).path) if uri.startswith("file:") else uri
