import sys

from backend.monitor.cli import main

sys.exit(main())
