"""Admission control: tenants, quotas, priority bands and fair queues.

Admission answers *when* a request may proceed; the scheduler answers *where*.
It sits between parsing/authentication and scheduling, behind the router's
Gate seam. See docs/admission.md.
"""

from .config import AdmissionSettings, BandConfig, QuotasConfig, TenantConfig, validate
from .controller import GRANTED, QUEUED, Controller, Ticket
from .errors import AdmissionRejected
from .gate import AdmissionGate, estimate_tokens
from .seam import Gate, Grant

__all__ = [
    "GRANTED",
    "QUEUED",
    "AdmissionGate",
    "AdmissionRejected",
    "AdmissionSettings",
    "BandConfig",
    "Controller",
    "Gate",
    "Grant",
    "QuotasConfig",
    "TenantConfig",
    "Ticket",
    "estimate_tokens",
    "validate",
]
