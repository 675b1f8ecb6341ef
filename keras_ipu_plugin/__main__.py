"""`python -m keras_ipu_plugin COMMAND ...`: see `keras_ipu_plugin.cli`."""

import sys

from keras_ipu_plugin.cli import main

if __name__ == "__main__":
    sys.exit(main())
