"""The merge policy: how the queues of one worker pool share its dispatches
(``PIPELINE_MERGE_POLICY``; docs/scheduling.md, "Merge policies")."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
POLICIES = ("random-robin", "tier-priority")
TIERS = {"interactive": 0, "async": 1, "batch": 2}
LANES = tuple(f"{c}-{t}" for c in ("reserved", "overflow") for t in TIERS)  # class × 3 + tier
_COMMON = ("fairness_header", "fairness_attribute")
_PARAMS = {
    "random-robin": _COMMON,
    "tier-priority": (
        *_COMMON,
        "tier_label",
        "priority_header",
        "objective_header",
        "lane_objectives",
        "max_lane_wait",
    ),
}


@dataclass(frozen=True)
class MergePolicy:
    type: str = "random-robin"
    tier_label: str = "tier"
    priority_header: str = ""
    objective_header: str = "x-llm-d-inference-objective"
    lane_objectives: dict[str, str] = field(default_factory=dict)
    max_lane_wait: int = 15  # a waiting lane is passed over at most this often in a row
    fairness_header: str | None = None  # None: PIPELINE_FAIRNESS_HEADER
    fairness_attribute: str | None = None  # None: PIPELINE_FAIRNESS_ATTRIBUTE

    @property
    def tiered(self) -> bool:
        return self.type == "tier-priority"

    def lane(self, labels: dict[str, str]) -> int:
        """The lane of a queue with these labels (0 = highest); 0 for every queue under
        ``random-robin`` (one lane)."""
        if not self.tiered:
            return 0
        tier = TIERS.get(labels.get(self.tier_label, ""), 2)
        klass = 0 if labels.get("classification") == "reserved" else 1
        return klass * 3 + tier

    def headers(self, labels: dict[str, str]) -> dict[str, str]:
        """Headers a queue's requests carry because of their lane (stamped after the caller's
        own): the lane index in ``priority_header``, the lane's objective in
        ``objective_header``."""
        if not self.tiered:
            return {}
        lane = self.lane(labels)
        out: dict[str, str] = {}
        if self.priority_header:
            out[self.priority_header] = str(lane)
        objective = self.lane_objectives.get(LANES[lane])
        if objective and self.objective_header:
            out[self.objective_header] = objective
        return out


def parse_merge_policy(data: Any, source: str) -> MergePolicy:
    """Validate a merge policy file's content; ConfigError naming ``source`` and the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a merge policy must be a JSON object")
    unknown = sorted(set(data) - {"type", "parameters"})
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)}")
    kind = data.get("type")
    if kind not in POLICIES:
        raise ConfigError(f"{source}: type must be one of {', '.join(POLICIES)}, not {kind!r}")
    params = data.get("parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: parameters must be an object")
    unknown = sorted(set(params) - set(_PARAMS[kind]))
    if unknown:
        raise ConfigError(f"{source}: unknown {kind} parameter(s) {', '.join(unknown)}")
    return MergePolicy(type=kind, **_params(params, f"{source}: parameters."))


def _params(params: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("tier_label", "fairness_attribute"):
        if name in params:
            value = params[name]
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}{name} must be a non-empty string")
            out[name] = value
    for name in ("priority_header", "objective_header", "fairness_header"):
        if name in params:
            value = params[name]
            if not isinstance(value, str) or (value and not HEADER_NAME.match(value)):
                raise ConfigError(f"{where}{name}: {value!r} is not a legal HTTP header name")
            out[name] = value
    if "lane_objectives" in params:
        out["lane_objectives"] = _lane_objectives(params["lane_objectives"], where)
    if "max_lane_wait" in params:
        value = params["max_lane_wait"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}max_lane_wait must be an int >= 0")
        out["max_lane_wait"] = value
    return out


def _lane_objectives(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}lane_objectives must be an object")
    for lane, objective in value.items():
        if lane not in LANES:
            known = ", ".join(LANES)
            raise ConfigError(f"{where}lane_objectives: unknown lane {lane!r} (lanes: {known})")
        if not isinstance(objective, str) or not objective.isprintable() or not objective:
            raise ConfigError(f"{where}lane_objectives.{lane} must be a non-empty string")
    return dict(value)
