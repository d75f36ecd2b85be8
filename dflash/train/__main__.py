import sys

from dflash.train import main

sys.exit(main(sys.argv[1:]))
