"""The fault-injection suite (issue 41): one request, client or socket behaving badly never hurts another.
CPU, the built-in model; each test well under 20 s on 2 cores. The server helper is the application tests'."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "apps"))
