import sys

from atlas.app.launch import main

sys.exit(main())
