"""Image pulls on the process kubelet: which images cannot be pulled, and what the kubelet
then reports (``ErrImagePull``, ``ImagePullBackOff``, ``InvalidImageName``,
``ErrImageNeverPull``), in the kubelet's and containerd's words.

Why: a container here is a process of the machine and its image only a name, so every image
"pulled" and a RolloutRun whose image a real cluster could not pull looked fine here; the
operator's surfacing of a stuck pull was only unit-tested. So the kubelet resolves each
image as a runtime would: a reference Docker cannot parse is ``InvalidImageName``; an image
on a registry that cannot exist (a host under the reserved ``.invalid`` top-level domain,
RFC 2606) or one the cluster was told to refuse (``LocalCluster(unpullable_images=...)``,
``ROLLOUTRUN_LOCALCLUSTER_UNPULLABLE_IMAGES``, or :meth:`Images.refuse` while it runs) fails
to pull; with ``imagePullPolicy: Never`` it is "not present". Every other image pulls. A
failed pull is retried with the kubelet's image back-off (10 s doubling to 5 min, its base
configurable), ``ImagePullBackOff`` reported in between.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

ENV_UNPULLABLE = "ROLLOUTRUN_LOCALCLUSTER_UNPULLABLE_IMAGES"
#: The kubelet's image pull back-off: first delay and cap (seconds).
IMAGE_BACKOFF = (10.0, 300.0)

# Docker's reference grammar (distribution/reference), enough to refuse what it refuses.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_REFERENCE = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?$"
)


@dataclass(frozen=True)
class PullFailure:
    """Why an image did not pull: the waiting ``reason`` and the kubelet's ``message``;
    ``retried`` says whether the kubelet backs off and tries again."""

    reason: str
    message: str
    retried: bool = True


def normalize(image: str) -> str | None:
    """The fully qualified reference a runtime pulls (``x`` is ``docker.io/library/x:latest``),
    or None when the reference is invalid."""
    match = _REFERENCE.match(image)
    if match is None:
        return None
    domain, path = match["domain"], match["path"]
    if domain is None or ("." not in domain and ":" not in domain and domain != "localhost"):
        path = f"{domain}/{path}" if domain else path
        domain = "docker.io"
        if "/" not in path:
            path = f"library/{path}"
    tag = match["tag"] or ("" if match["digest"] else "latest")
    return (
        f"{domain}/{path}"
        + (f":{tag}" if tag else "")
        + (f"@{match['digest']}" if match["digest"] else "")
    )


class Images:
    """The cluster's view of which images exist; shared by its kubelets."""

    def __init__(self, unpullable: Iterable[str] = ()) -> None:
        self._refused: set[str] = set()
        for image in unpullable:
            self.refuse(image)

    @classmethod
    def from_env(cls, unpullable: Iterable[str] = ()) -> Images:
        listed = [i.strip() for i in os.environ.get(ENV_UNPULLABLE, "").split(",") if i.strip()]
        return cls([*unpullable, *listed])

    def refuse(self, image: str) -> None:
        """From now on ``image`` cannot be pulled (as if deleted from its registry)."""
        self._refused.add(normalize(image) or image)

    def allow(self, image: str) -> None:
        """``image`` can be pulled again (as if pushed)."""
        self._refused.discard(normalize(image) or image)

    def pull(self, image: str, policy: str) -> PullFailure | None:
        """What pulling ``image`` under ``imagePullPolicy`` ``policy`` does: None if it pulls.
        A container without an image (the emulator does not require one) has nothing to pull."""
        if not image:
            return None
        full = normalize(image)
        if full is None:
            return PullFailure(
                "InvalidImageName",
                f'Failed to apply default image tag "{image}": couldn\'t parse image name '
                f'"{image}": invalid reference format',
                retried=False,
            )
        domain = full.split("/", 1)[0].split(":", 1)[0]
        missing = domain.endswith(".invalid") or full in self._refused
        if not missing:
            return None
        if policy == "Never":
            return PullFailure(
                "ErrImageNeverPull",
                f'Container image "{image}" is not present with pull policy of Never',
            )
        if domain.endswith(".invalid"):
            repository, _, reference = full.partition("/")[2].rpartition(":")
            why = (
                f'failed to do request: Head "https://{domain}/v2/{repository}/manifests/'
                f'{reference}": dial tcp: lookup {domain}: no such host'
            )
        else:
            why = (
                "pull access denied, repository does not exist or may require authorization: "
                "server message: insufficient_scope: authorization failed"
            )
        return PullFailure(
            "ErrImagePull",
            f'failed to pull and unpack image "{full}": failed to resolve reference '
            f'"{full}": {why}',
        )


def backoff_message(image: str, failure: PullFailure) -> str:
    """``ImagePullBackOff``'s message: the back-off, then the last pull's error."""
    return f'Back-off pulling image "{image}": {failure.reason}: {failure.message}'
