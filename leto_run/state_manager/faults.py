"""Compatibility home of `fire_pages_spec`; it lives in `leto_runtime.rmp.faults` so the runtime
(which never imports `leto_run`) can fire step-triggered page faults too."""
from leto_runtime.rmp.faults import PAGE_KEYS, fire_pages_spec

__all__ = ["PAGE_KEYS", "fire_pages_spec"]
