"""``python -m macattn``: the ``macattn`` command (``macattn.cli``)."""
import sys

from macattn.cli import main

sys.exit(main())
