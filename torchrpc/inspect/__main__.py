"""``python -m torchrpc.inspect``: see :mod:`torchrpc.inspect`."""

import os
import sys

if __name__ == "__main__":
    # torch's store client logs each failed try to stderr from C++; the error says it once.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from . import main  # after the variable above, which torch reads when it loads

    sys.exit(main())
