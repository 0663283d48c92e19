"""``python -m torchrpc.inspect``: see :mod:`torchrpc.inspect`."""

import os
import sys

# torch's store client logs each failed try to stderr from C++; the error says it once.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from . import main  # noqa: E402 - after the variable above, which torch reads at import

sys.exit(main())
