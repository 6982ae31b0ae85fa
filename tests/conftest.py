"""Make the shared test helpers (``_tiny_llama``) importable here and in the rank processes."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
