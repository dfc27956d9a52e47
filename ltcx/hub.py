"""Is the Hugging Face hub reachable? Asked once before ``datasets`` or ``transformers`` would spend 30-70 s
retrying, so that offline the user's one-line answer comes at once."""

from __future__ import annotations

import contextlib
import os
import socket
import urllib.parse
import urllib.request

PROBE_TIMEOUT_S = 3.0


def hub_unreachable(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub can not be used now (offline mode is set, or no TCP connection to it, or to the HTTPS proxy,
    within ``timeout`` seconds), or None when it can."""
    from huggingface_hub import constants

    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    if constants.HF_HUB_OFFLINE or any(os.environ.get(f, "").upper() in ("1", "ON", "YES", "TRUE") for f in flags):
        return "offline mode is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(url.scheme)
    target = urllib.parse.urlsplit(proxy) if proxy and not urllib.request.proxy_bypass(url.hostname) else url
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((target.hostname, port), timeout=timeout).close()
    except OSError as error:
        return f"no connection to {target.hostname}:{port} within {timeout:g} s: {error.strerror or error}"
    return None


@contextlib.contextmanager
def cache_only():
    """Within: ``huggingface_hub`` and ``datasets`` in offline mode (as ``HF_HUB_OFFLINE=1`` sets it at their
    import), for a hub found unreachable: a data set in the local cache still loads, another fails at once instead
    of after minutes of retries. The settings before are restored after."""
    import datasets.config
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved
