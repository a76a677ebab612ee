"""python -m launcher.config [section ...]: every key, its type, default and meaning."""

import sys

from launcher.config.doc import main

sys.exit(main())
