"""Record the ``kubernetes`` client surface the trainer's Lease client may use.

Why: ``coordination.py`` once called ``ApiClient.param_serialize`` (kubernetes >= 36 only)
while the project pins ``kubernetes>=29``. test_kubernetes_surface.py checks every name and
keyword argument coordination.py uses against what this script recorded from the minimum
supported version. Re-record when the pin moves, in a venv holding exactly that version::

    python3.11 -m venv /tmp/k29 && /tmp/k29/bin/pip install kubernetes==29.0.0
    /tmp/k29/bin/python tests/runtime/coordination/record_kubernetes_surface.py
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

OUTPUT = Path(__file__).with_name("kubernetes_min_surface.json")


def public(obj: object) -> list[str]:
    return sorted(name for name in dir(obj) if not name.startswith("__"))


def accepted_params(method: object) -> list[str]:
    """Keyword arguments a generated API method accepts (its ``all_params`` list)."""
    source = inspect.getsource(method)  # type: ignore[arg-type]
    names = re.findall(r"'(\w+)'", source.split("all_params", 1)[1].split("for key", 1)[0])
    return sorted(set(names))


def main() -> None:
    import kubernetes
    from kubernetes import client, config
    from kubernetes.client import exceptions

    api = client.CoordinationV1Api
    methods = [name for name in public(api) if not name.startswith("_")]
    surface = {
        "version": kubernetes.__version__,
        "modules": {
            "kubernetes.client": public(client),
            "kubernetes.config": public(config),
            "kubernetes.client.exceptions": public(exceptions),
        },
        "ApiClient": public(client.ApiClient),
        "CoordinationV1Api": {
            name: accepted_params(getattr(api, f"{name}_with_http_info"))
            for name in methods
            if not name.endswith("_with_http_info") and name != "api_client"
        },
        "models": {
            name: sorted(getattr(client, name).openapi_types)
            for name in ("V1Lease", "V1LeaseSpec", "V1ObjectMeta")
        },
    }
    OUTPUT.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
    print(f"recorded kubernetes {kubernetes.__version__} into {OUTPUT}")


if __name__ == "__main__":
    main()
