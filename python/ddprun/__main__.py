"""python3 -m ddprun ARGS: the installed launcher with ARGS (as python3 -m torch.distributed.run)."""
import sys

from ddprun import main

sys.exit(main())
