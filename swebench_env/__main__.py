import sys

from swebench_env.cli import main

sys.exit(main())
