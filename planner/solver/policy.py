"""The verification policy a plan must satisfy."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from planner.errors import InvalidInputError

VerifierPlacement = Literal["any", "stage", "cpu"]


@dataclass(frozen=True, slots=True, kw_only=True)
class VerificationPolicy:
    """What must be checked and where verifiers may live.

    Every stage boundary whose sender is untrusted is checked (activations,
    and gradients when ``check_gradients``) by a verifier on a trusted device
    outside the sender's trust domain. ``verifier_placement``: ``stage`` =
    only on trusted devices that run a stage, ``cpu`` = only on CPU-only
    trusted verifier hosts, ``any`` = either. ``ban_excludes_domain``: a ban
    re-plans without the banned host's whole trust domain (one operator's
    machines), not the host alone. ``link_test_cost``: the share of step time a verifier placement that
    keeps the untrusted stages' link and residual tests may cost over the cheapest one (beyond it the plan
    keeps the cheaper placement and says which tests it lost; damping by 0.5 passes the weaker tests).
    ``audit_cost``: the share of step time the audits of watched replicated stages may cost together
    (``planner.solver.audits``; 0: none). ``audit_within_steps``: how many steps a replica corrupting all its
    microbatches may go unaudited (with probability ``audits.MISS_TARGET``): 1 audits every microbatch of a
    replica with one a step, so an attack is caught on its first step, at a full recompute's price.
    """

    enabled: bool = True
    trusted_endpoints: bool = True
    check_gradients: bool = True
    max_boundaries_per_verifier: int | None = None
    verifier_placement: VerifierPlacement = "any"
    ban_excludes_domain: bool = False
    link_test_cost: float = 0.05
    audit_cost: float = 0.05
    audit_within_steps: int = 10

    def __post_init__(self) -> None:
        if self.verifier_placement not in ("any", "stage", "cpu"):
            raise InvalidInputError("verifier_placement", expected="any, stage or cpu",
                                    found=repr(self.verifier_placement))
        if not 0.0 <= self.link_test_cost <= 10.0:
            raise InvalidInputError("link_test_cost", expected="a share of the step time in 0..10 (0.05: 5%)",
                                    found=str(self.link_test_cost), fix="pass --link-tests-cost between 0 and 10")
        if not 0.0 <= self.audit_cost <= 10.0:
            raise InvalidInputError("audit_cost", expected="a share of the step time in 0..10 (0.05: 5%)",
                                    found=str(self.audit_cost), fix="pass --audit-cost between 0 and 10")
        if isinstance(self.audit_within_steps, bool) or not isinstance(self.audit_within_steps, int) \
                or not 1 <= self.audit_within_steps <= 1000:
            raise InvalidInputError("audit_within_steps", expected="a whole number of steps in 1..1000 (10: default)",
                                    found=repr(self.audit_within_steps), fix="pass --audit-within between 1 and 1000")
        if self.max_boundaries_per_verifier is not None and self.max_boundaries_per_verifier < 1:
            raise InvalidInputError("max_boundaries_per_verifier", expected=">= 1 or unset",
                                    found=str(self.max_boundaries_per_verifier))

    def to_dict(self) -> dict:
        return {"enabled": self.enabled, "trusted_endpoints": self.trusted_endpoints,
                "check_gradients": self.check_gradients,
                "max_boundaries_per_verifier": self.max_boundaries_per_verifier,
                "verifier_placement": self.verifier_placement, "ban_excludes_domain": self.ban_excludes_domain,
                "link_test_cost": self.link_test_cost, "audit_cost": self.audit_cost,
                "audit_within_steps": self.audit_within_steps}

    @classmethod
    def from_dict(cls, d: dict) -> VerificationPolicy:
        return cls(**d)
