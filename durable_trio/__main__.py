"""``python -m durable_trio`` is the ``durable-trio`` command."""

from __future__ import annotations

import sys

from .cli._main import main

sys.exit(main())
