"""Continuous batching: admission.py, scheduler.py (plans), commit.py, recovery.py, integrity.py."""

from refengine.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
