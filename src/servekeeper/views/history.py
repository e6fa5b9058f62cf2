"""A service's revisions as the API shows them (pure)."""

from __future__ import annotations

from servekeeper.model.records import Revision
from servekeeper.model.wire import RevisionView


def revision_view(revision: Revision, current: int) -> RevisionView:
    return {
        "revision": revision.revision,
        "current": revision.revision == current,
        "createdAt": revision.created_at,
        "specHash": revision.spec_hash,
        "packageHash": revision.package_hash,
        "cause": revision.cause,
        "outcome": revision.outcome,
        "endedAt": revision.ended_at,
        "endedBy": revision.ended_by,
        "message": revision.message,
    }
