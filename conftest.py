"""Test-suite configuration: a reproducible hypothesis profile, and the example project is not ours."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

collect_ignore = ["examples", "benchmarks"]
