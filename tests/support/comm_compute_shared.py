"""Shared by test_comm_compute.py and test_comm_compute_jobs.py (single-process and job tests)."""

from __future__ import annotations


CATS = ("compute_ms", "overlapped_ms", "exposed_comm_ms", "data_ms", "other_ms", "idle_ms")
