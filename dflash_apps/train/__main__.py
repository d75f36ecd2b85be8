import sys

from dflash_apps.train import main

sys.exit(main(sys.argv[1:]))
