"""A canary's declared shape: Argo-Rollouts-like steps, analysis thresholds and header routes."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import re2
from pydantic import BeforeValidator, Field, field_validator, model_validator

from servekeeper.model.base import StrictModel
from servekeeper.model.routing import HeaderMatch

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _seconds(value: Any) -> Any:
    """ "30s", "2m", "1.5h", "250ms" or a plain number of seconds (Argo Rollouts' duration shape)."""
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(f"{value!r} is not a duration like '30s', '2m' or '1h'")
        return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    return value


Duration = Annotated[float, BeforeValidator(_seconds), Field(ge=0, le=7 * 86400)]


class PauseSpec(StrictModel):
    duration: Duration | None = None  # None: wait for `servekeeper promote`


# An HTTP header name (RFC 9110's token): no pseudo-header (":path") and nothing Envoy would reject.
_HEADER_NAME = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}$"


# Envoy refuses an RE2 program larger than this (its runtime's re2.max_program_size.error_level).
RE2_MAX_PROGRAM_SIZE = 100
# Names a request never carries as such towards a route match: HTTP/2 turns `host` into
# `:authority`, and the hop-by-hop ones are consumed by the proxy.
_UNMATCHABLE_HEADERS = {"host", "connection", "upgrade", "te", "transfer-encoding", "keep-alive", "proxy-connection"}


def re2_problem(pattern: str) -> str | None:
    """Why Envoy (RE2) would refuse `pattern`, or None. Python's re accepts what RE2 does not
    (lookarounds, backreferences), and a pattern may compile to a program Envoy finds too large."""
    options = re2.Options()
    options.log_errors = False  # the message goes to the user, not to stderr
    try:
        size = re2.compile(pattern, options).programsize
    except re2.error as exc:
        detail = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        return f"regex {pattern!r} is not RE2 (Envoy's regex engine): {detail}"
    if size > RE2_MAX_PROGRAM_SIZE:
        return f"regex {pattern!r} compiles to an RE2 program of size {size}, over Envoy's limit {RE2_MAX_PROGRAM_SIZE}"
    return None


class HeaderRouteSpec(StrictModel):
    """Requests with this header go to the canary while one runs, whatever its weight (testers
    and internal traffic pinned to the new version). Exactly one of `value` (an exact match) and
    `regex` (an RE2 pattern the whole value must match)."""

    header: str = Field(pattern=_HEADER_NAME)
    value: str | None = Field(default=None, min_length=1, max_length=1000)
    regex: str | None = Field(default=None, min_length=1, max_length=1000)

    @model_validator(mode="after")
    def _one_match(self) -> HeaderRouteSpec:
        if (self.value is None) == (self.regex is None):
            raise ValueError("a header route matches either {value: ...} or {regex: ...}")
        if self.regex is not None:
            problem = re2_problem(self.regex)
            if problem is not None:
                raise ValueError(problem)
        if self.value is not None and self.value != self.value.strip():
            raise ValueError("value has spaces at its ends: HTTP drops them, so no request would match")
        return self

    @field_validator("header")
    @classmethod
    def _matchable(cls, header: str) -> str:
        if header.lower() in _UNMATCHABLE_HEADERS:
            raise ValueError(f"{header!r} cannot be matched: the proxy rewrites or consumes it")
        return header

    def match(self) -> HeaderMatch:
        if self.regex is not None:
            return HeaderMatch(self.header.lower(), self.regex, regex=True)
        assert self.value is not None  # one of the two, checked above
        return HeaderMatch(self.header.lower(), self.value)


HttpMethod = Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def _reads() -> list[HttpMethod]:
    return ["GET", "HEAD"]


class MirrorSpec(StrictModel):
    """A shadow step: `percent` of the requests to the stable cluster are also sent to the canary
    for `duration` (or until `promote`); clients get the stable answer only, and analysis judges
    the canary on its answers to the copies. Only `methods` are copied: GET and HEAD unless told,
    since copying a write makes the canary do it too (the user's explicit choice)."""

    percent: int = Field(ge=1, le=100)
    duration: Duration | None = None  # None: until `servekeeper promote`
    methods: list[HttpMethod] = Field(default_factory=_reads, min_length=1)


class CanaryStepSpec(StrictModel):
    """One step, exactly one of: move the canary's weight, pause, turn a header route on, or
    copy traffic to the canary (a shadow step)."""

    setWeight: int | None = Field(default=None, ge=0, le=100)
    pause: PauseSpec | None = None
    setHeaderRoute: HeaderRouteSpec | None = None
    mirror: MirrorSpec | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> CanaryStepSpec:
        if [self.setWeight, self.pause, self.setHeaderRoute, self.mirror].count(None) != 3:
            raise ValueError(
                "a step is one of {setWeight: N}, {pause: {...}}, {setHeaderRoute: {...}} or {mirror: {...}}"
            )
        return self


class MinThreshold(StrictModel):
    min: float = Field(ge=0, le=1)


class MaxThreshold(StrictModel):
    max: float = Field(gt=0)


class AnalysisSpec(StrictModel):
    """Checked every interval while the canary has traffic, from the ingress's own counters."""

    interval: Duration = Field(default=10, gt=0)
    minRequests: int = Field(default=50, ge=1)  # fewer in an interval: inconclusive, neither pass nor fail
    successRate: MinThreshold | None = None  # share of non-5xx answers
    latencyP99Ms: MaxThreshold | None = None
    failureLimit: int = Field(default=1, ge=0, le=1000)  # failed intervals tolerated; one more aborts

    @model_validator(mode="after")
    def _something_to_check(self) -> AnalysisSpec:
        if self.successRate is None and self.latencyP99Ms is None:
            raise ValueError("analysis needs successRate or latencyP99Ms (or both)")
        return self


class CanarySpec(StrictModel):
    steps: list[CanaryStepSpec] = Field(min_length=1, max_length=100)
    analysis: AnalysisSpec | None = None
    capacityFollowsTraffic: bool = False
    headerRoute: HeaderRouteSpec | None = None  # on from the canary's start (a setHeaderRoute step: from there)

    @model_validator(mode="after")
    def _weights_make_sense(self) -> CanarySpec:
        for index, step in enumerate(self.steps):
            if step.setWeight == 100 and index != len(self.steps) - 1:
                raise ValueError(f"steps[{index}]: setWeight 100 promotes the canary; it can only be the last step")
            mirror = step.mirror
            if self.analysis and mirror and mirror.duration is not None and mirror.duration < self.analysis.interval:
                raise ValueError(
                    f"steps[{index}]: a mirror of {mirror.duration:g}s ends before one analysis interval "
                    f"({self.analysis.interval:g}s): its copies would never be judged"
                )
        return self
