import sys

from xferlib.cli import main

sys.exit(main())
