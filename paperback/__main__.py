import sys

from paperback.cli import main

sys.exit(main())
