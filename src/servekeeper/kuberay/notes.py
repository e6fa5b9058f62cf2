"""Pure: what an import of a KubeRay manifest tells the user about fields that do not apply here,
and the findings every part of the translation reports into."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class NoteKind(str, enum.Enum):
    IGNORED = "ignored"  # accepted and without effect on this provider
    OVERRIDDEN = "overridden"  # servekeeper sets it itself
    CHANGED = "changed"  # applied, but not the way KubeRay would
    SKIPPED = "skipped"  # a document of the file that is not a RayService


@dataclass(frozen=True)
class Note:
    kind: NoteKind
    path: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "path": self.path, "message": self.message}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Note:
        return cls(kind=NoteKind(data["kind"]), path=str(data["path"]), message=str(data["message"]))

    def __str__(self) -> str:
        return f"{self.path}: {self.kind.value}: {self.message}"


@dataclass(frozen=True)
class SecretRef:
    """An env value that came from `valueFrom.secretKeyRef`: exported as a reference again,
    never as its value."""

    group: str  # "head" or a worker group's name
    env: str
    secret: str
    key: str

    def to_json(self) -> dict[str, str]:
        return {"group": self.group, "env": self.env, "secret": self.secret, "key": self.key}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SecretRef:
        return cls(group=str(data["group"]), env=str(data["env"]), secret=str(data["secret"]), key=str(data["key"]))


@dataclass
class Findings:
    """What the parts of one import found: refusals (raised together as one SpecError), notes,
    and the env values that came from secrets."""

    problems: list[str] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    secret_refs: list[SecretRef] = field(default_factory=list)

    def refuse(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def note(self, kind: NoteKind, path: str, message: str) -> None:
        self.notes.append(Note(kind, path, message))
