"""``python -m kvmesh.settings``: every ``KVMESH_*`` variable, as a Markdown table."""

import sys

from kvmesh.settings.env import table

sys.stdout.write(table() + "\n")
