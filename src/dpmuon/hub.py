"""The Hugging Face hub, as the loaders reach it (tokenizers, model configs and weights).

Offline, `huggingface_hub` retries each request with backoff: a tokenizer or model named by hub
id failed only after about a minute of warnings. One short connection attempt tells sooner;
when the hub does not answer, the loaders look in the local cache alone (`local_files_only`),
which is where they would have ended up anyway, so a cached model still loads and a missing one
fails at once with the loader's own one-line error. A local directory never asks the hub.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

CONNECT_SECONDS = 3.0
# Through a proxy, only the real request can tell whether the hub answers.
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def local_files_only(name_or_path: str) -> bool:
    """Whether `from_pretrained(name_or_path)` should skip the hub: the name is no local directory
    and the hub is offline (HF_HUB_OFFLINE) or does not answer."""
    return not Path(name_or_path).expanduser().is_dir() and hub_unreachable()


@functools.cache
def hub_unreachable() -> bool:
    """Asked once per process: HF_HUB_OFFLINE, or no TCP connection to the hub's endpoint
    (HF_ENDPOINT, a mirror, included) within CONNECT_SECONDS."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return False
    endpoint = urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=CONNECT_SECONDS).close()
    except OSError:  # no name resolution, no route, refused, timed out
        return True
    return False
