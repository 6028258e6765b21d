"""Shared by test_multinode.py and test_launcher_liveness.py (single-process and job tests)."""

from __future__ import annotations

import socket


HOST = socket.gethostname()
