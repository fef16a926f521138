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
    machines), not the host alone.
    """

    enabled: bool = True
    trusted_endpoints: bool = True
    check_gradients: bool = True
    max_boundaries_per_verifier: int | None = None
    verifier_placement: VerifierPlacement = "any"
    ban_excludes_domain: bool = False

    def __post_init__(self) -> None:
        if self.verifier_placement not in ("any", "stage", "cpu"):
            raise InvalidInputError("verifier_placement", expected="any, stage or cpu",
                                    found=repr(self.verifier_placement))
        if self.max_boundaries_per_verifier is not None and self.max_boundaries_per_verifier < 1:
            raise InvalidInputError("max_boundaries_per_verifier", expected=">= 1 or unset",
                                    found=str(self.max_boundaries_per_verifier))

    def to_dict(self) -> dict:
        return {"enabled": self.enabled, "trusted_endpoints": self.trusted_endpoints,
                "check_gradients": self.check_gradients,
                "max_boundaries_per_verifier": self.max_boundaries_per_verifier,
                "verifier_placement": self.verifier_placement, "ban_excludes_domain": self.ban_excludes_domain}

    @classmethod
    def from_dict(cls, d: dict) -> "VerificationPolicy":
        return cls(**d)
