"""A process node's container launcher starts without the site-packages: it runs before every container
(and before each pod's pause and sandbox), and needs only the standard library and ``testenv``."""

from __future__ import annotations

import json
import subprocess

from testenv.processnode.container import LaunchSpec, launch_argv


def test_the_launcher_interpreter_loads_no_site_packages() -> None:
    argv = launch_argv(LaunchSpec(command=["true"]))
    python, flags = argv[0], argv[1 : argv.index("-c")]
    probe = "import json, sys; print(json.dumps([sys.flags.no_site, [p for p in sys.path if 'packages' in p]]))"
    out = subprocess.run([python, *flags, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    no_site, site_dirs = json.loads(out.stdout)
    assert no_site == 1 and site_dirs == [], (flags, site_dirs)
