"""What kind of document a spec file holds, told apart before anything is parsed: the client and
the apply command both ask, and neither needs the KubeRay translation for it."""

from __future__ import annotations

from typing import Any

KUBERAY_API_VERSIONS = ("ray.io/v1", "ray.io/v1alpha1")


def is_kuberay(documents: list[Any]) -> bool:
    """Is this (multi-document) file a KubeRay manifest rather than a servekeeper spec?"""
    return any(isinstance(d, dict) and d.get("apiVersion") in KUBERAY_API_VERSIONS for d in documents)
