"""Data by URL: an https:// (or http://) input file is downloaded once, with progress, into
fs.cache_root()/downloads/, and read from there afterwards.

The cached copy is keyed by the URL; it is written to a temporary name, checked against the
server's Content-Length, and renamed into place, so an interrupted download never leaves a
file that looks whole (the next run downloads it again). REALM_JAX_CACHE moves the cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request

from realm_jax import fs

log = logging.getLogger(__name__)

SCHEMES = ("https://", "http://")
TIMEOUT_S = 60  # per socket operation, not for the whole file


class DownloadError(OSError):
    """A URL that cannot be downloaded (HTTP error, unreachable, cut short)."""


def is_url(path) -> bool:
    return isinstance(path, str) and path.lower().startswith(SCHEMES)


def cached_path(url: str) -> str:
    """Where `url`'s copy lives (whether or not it is there yet): its file name kept, so the
    format is still read from the extension."""
    name = os.path.basename(urllib.parse.urlparse(url).path) or "download"
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    return os.path.join(fs.cache_root(), "downloads", key, name)


def local(path: str) -> str:
    """`path` unchanged unless it is an http(s) URL; then the local cached copy (downloaded on
    first use)."""
    if not is_url(path):
        return path
    dest = cached_path(path)
    if os.path.isfile(dest):
        log.info("%s: the cached copy %s", path, dest)
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.part-{os.getpid()}"
    try:
        _fetch(path, tmp)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


def _fetch(url: str, tmp: str) -> None:
    from tqdm import tqdm

    request = urllib.request.Request(url, headers={"User-Agent": "realm-jax"})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)  # noqa: S310 (http(s) only)
    except urllib.error.HTTPError as e:
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise DownloadError(
            f"{url}: cannot be downloaded ({reason}); download it yourself and pass the local "
            "file instead"
        ) from None
    with response:
        total = int(response.headers.get("Content-Length") or 0) or None
        got, start = 0, time.time()
        name = os.path.basename(tmp).rsplit(".part-", 1)[0]
        with (
            open(tmp, "wb") as f,
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                desc=f"downloading {name}",
                leave=False,
                disable=None,  # a terminal only: no carriage returns in a log file
            ) as bar,
        ):
            while True:
                try:
                    chunk = response.read(1 << 20)
                except OSError as e:
                    raise DownloadError(
                        f"{url}: the download stopped at {got} bytes ({e})"
                    ) from None
                if not chunk:
                    break
                f.write(chunk)
                got += len(chunk)
                bar.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
    if total is not None and got != total:
        raise DownloadError(f"{url}: the download stopped after {got} of {total} bytes")
    log.info("downloaded %s (%d bytes, %.1f s)", url, got, time.time() - start)
