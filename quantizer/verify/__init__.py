"""The verify stage: a pack checked against its own manifest."""

from quantizer.verify.checks import Finding, VerifyReport, verify_pack

__all__ = ["Finding", "VerifyReport", "verify_pack"]
