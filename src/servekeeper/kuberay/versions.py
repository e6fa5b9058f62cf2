"""Pure: the Ray release and Python a RayService's nodes ask for, read from `rayVersion` and the
Ray images' tags (`rayproject/ray:2.52.0-py311-gpu`: Ray 2.52.0 on Python 3.11; the `-gpu` and
`-cu12x` variants say nothing more here), as servekeeper's `rayVersion` and `pythonVersion`:
the cluster gets an environment of its own with them (issue 21). Each is left unset where it is
the controller's own, so a manifest on the controller's Ray imports as it always did."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from servekeeper.kuberay.notes import Findings, NoteKind

# "2.52.0", "2.52.0-py311-gpu", "2.46.0.0e19ea-py39-gpu" (a release's build with its commit)
IMAGE_TAG = re.compile(r"^(\d+\.\d+\.\d+)(?:\.[0-9a-f]+)?(?:-py3(\d{1,2}))?(?:-|$)")
RAY_VERSION = re.compile(r"^(\d+\.\d+\.\d+)$")


@dataclass
class DeclaredVersions:
    """What each field and image of one cluster declares, by path; `fields()` settles them."""

    findings: Findings
    ray: list[tuple[str, str]] = field(default_factory=list)  # (path, "2.52.0")
    python: list[tuple[str, str]] = field(default_factory=list)  # (path, "3.11")

    def read_ray_version(self, path: str, text: str) -> None:
        match = RAY_VERSION.match(text)
        if match is None:
            self.findings.note(NoteKind.IGNORED, path, f"rayVersion {text!r} names no Ray release; not used")
            return
        self.ray.append((path, match.group(1)))

    def read_image(self, path: str, image: str) -> None:
        tag = image.rsplit("/", 1)[-1].partition("@")[0]
        name, _, version = tag.partition(":")
        match = IMAGE_TAG.match(version)
        if match is None:
            message = f"image tag of {name} {version!r} names no Ray release; the cluster runs its rayVersion"
            self.findings.note(NoteKind.IGNORED, path, message)
            return
        self.ray.append((path, match.group(1)))
        if match.group(2) is not None:
            self.python.append((path, f"3.{match.group(2)}"))

    def fields(self, controller_ray: str, controller_python: str | None) -> dict[str, str]:
        """`rayVersion` and `pythonVersion` for the cluster, where not the controller's; a
        cluster whose nodes ask for different ones is refused (one cluster, one environment)."""
        settled: dict[str, str] = {}
        for key, declared, own in (
            ("rayVersion", self.ray, controller_ray),
            ("pythonVersion", self.python, controller_python),
        ):
            versions = sorted({version for _, version in declared})
            if len(versions) > 1:
                where = ", ".join(f"{path}: {version}" for path, version in declared)
                self.findings.refuse(declared[0][0], f"the nodes of one cluster run one {key}; these differ: {where}")
            elif versions and versions[0] != own:
                settled[key] = versions[0]
        return settled


def image_tag(ray: str, python: str | None) -> str:
    """The Ray image's tag for a cluster: `2.52.0`, or `2.52.0-py310` with its own Python."""
    return f"{ray}-py{python.replace('.', '')}" if python is not None else ray
