import sys

from atlas.app.cli import main

sys.exit(main())
