"""``python -m hyperfsdp_bench [options]``: the same as ``hyperfsdp bench [options]``."""

import sys
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
from .cli import main  # noqa: E402

sys.exit(main())
